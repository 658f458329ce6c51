/* native.h: the native route's custom-op library (mha_ep/native/__init__.py tells the story), and the header every
 * file of it includes first: what crosses files is declared here, what does not stays static in its file.
 *
 * One shared object plays two parts:
 *   - a CPython extension module (`import mha_ep._native`): the Python side configures it, and the CPU kernels'
 *     compute calls back into Python;
 *   - an ONNX Runtime custom-op library: SessionOptions.register_custom_ops_library(<the library>) makes ORT call
 *     RegisterCustomOps, which adds the domain `mha_ep` with MultiHeadAttention kernels for the CPU execution
 *     provider and, when the options ask for it, for CUDAExecutionProvider. ORT opens the same file Python
 *     loaded, so both parts share the library's globals.
 *
 * CUDA kernels run without Python on a repeated call signature. A call's signature (the node's attributes by id,
 * the device, every input's element type, shape and pointer alignment) keys a process-wide cache of plans. A plan
 * is what the Python planner decided once for that signature (mha_ep/native/plan.py, from the cuda backend's
 * pipeline): the output shapes, the scratch size, and the steps (kernel launches with their argument bytes and
 * where ORT's pointers go in them, TMA maps to encode, cuBLAS GEMMs, copies). A call binds ORT's input, output and
 * scratch pointers into the plan and launches it with the CUDA driver on ORT's stream. A missing plan is made by
 * calling the planner under the GIL (on the warm-up runs; ORT's CUDA graph capture then finds every plan).
 *
 * Build: the machine's C compiler and the Python headers alone. No ORT or CUDA header is used: the subset of the
 * ABI it calls is declared in ort_abi.h, pinned to OrtApi version ORT_API_USED (ordinals are positions in struct
 * OrtApi of onnxruntime_c_api.h, which is append-only), and libcuda / libcublas are opened with dlopen when a CUDA
 * kernel is first created. Nothing here aborts the process: every failure is an OrtStatus (or a Python exception).
 *
 * The files of mha_ep/native/csrc/, one concern each (setup.py compiles every .c of the folder into one shared
 * object; its hash covers every .c and .h):
 *   native.h        this header: the build's includes, the plan format, and the types, globals and functions
 *                   that the files share;
 *   ort_abi.h       the subset of ORT's C ABI: opaque types, struct OrtCustomOp, the OrtApi ordinals;
 *   status.c        ORT's API table (g_api) and the statuses made through it;
 *   cuda_loader.c   libcuda and libcublas, opened with dlopen on first use;
 *   plans.c         an encoded plan parsed, and the process-wide plan cache;
 *   python_side.c   the Python side: the callbacks configure() hands in, every entry into Python, its errors as
 *                   statuses;
 *   custom_op.c     the OrtCustomOp variants, a kernel's create and destroy, RegisterCustomOps;
 *   inputs.c        a call's input tensors, read off ORT and as Python sees them;
 *   cpu_compute.c   a CPU kernel's compute: the Python callback, and kernel_output for its outputs;
 *   cuda_compute.c  a CUDA kernel's compute: the call signature's plan, bound and launched on ORT's stream;
 *   reports.c       a shared-buffer kernel's reports: their sentence, each device's sticky report words;
 *   replay.c        a graph replay's copies, from Python (launch_copies): not the op;
 *   module.c        the CPython extension module: its methods' table and PyInit__native.
 */
#ifndef MHA_EP_NATIVE_H
#define MHA_EP_NATIVE_H

#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000 /* the stable ABI of Python 3.10: one build serves every later Python */
#include <Python.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ort_abi.h"

/* --------------------------------------------------------------- ORT's API table and statuses (status.c) */
extern const OrtApi* g_api; /* set once by RegisterCustomOps (custom_op.c) */
#define API(type, ordinal) ((type)(((void* const*)g_api)[ordinal]))

OrtStatus* make_status(int code, const char* format, ...);
void release_status(OrtStatus* status);
void status_text(OrtStatus* status, char* out, size_t size);

/* -------------------------------------------------------------------- the CUDA libraries (cuda_loader.c) */
typedef int CUresult;
typedef void* CUcontext;
typedef void* CUfunction;
typedef void* CUstream;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

/* cuda.h's CUlaunchAttribute and CUlaunchConfig (CUDA 12), for cuLaunchKernelEx */
#define CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6
typedef struct {
  int id;
  char pad[4];
  union {
    char pad[64];
    int programmaticStreamSerializationAllowed;
  } value;
} CUlaunchAttribute;
typedef struct {
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute* attrs;
  unsigned numAttrs;
} CUlaunchConfig;

typedef struct {
  int loaded;
  char error[512];
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*cuTensorMapEncodeTiled)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*,
                                     const uint32_t*, const uint32_t*, int, int, int, int);
  /* a shared buffer's status words (STEP_CHECK_STATUS, error_words): optional, checked where used */
  CUresult (*cuStreamIsCapturing)(CUstream, int*);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
  /* a graph replay's event pair (launch_copies): optional, checked where used */
  CUresult (*cuEventRecord)(void*, CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, void*, unsigned);
  /* programmatic launches (a CUDA 12 driver): optional, a plain launch without it */
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
} CudaDriver;

typedef struct {
  int tried;
  void* library;
  char error[512];
  int (*gemm)(void*, int, int, int, int, int, const void*, const void*, int, int, long long, const void*, int, int,
              long long, const void*, void*, int, int, long long, int, int, int);
} Cublas;

extern CudaDriver cu;
extern Cublas cublas;
extern pthread_mutex_t g_library_lock; /* loading the libraries; a device's sticky words and primary context */

int load_cuda(void);
int load_cublas(void);
const char* cu_error_text(CUresult result);

/* ---------------------------------------------------------- a shared-buffer kernel's reports (reports.c) */
#define MAX_DEVICES 64
extern CUdeviceptr g_error_device[MAX_DEVICES]; /* each device's sticky report words, 0 until error_words */

enum { DEVICE_OK = 0, PAST_LENGTH_RANGE = 1, PAST_PLUS_LENGTH = 2, BEAM_INDEX = 3, MASK_LENGTH = 4, BIAS_LENGTH = 5 };

void device_error_text(const int32_t* w, int64_t beams, char* out, size_t size);

/* --------------------------------------------------------------------------------------- plans (plans.c) */
/* The encoded plan (mha_ep/native/plan.py encode_plan) is a sequence of little-endian int64 words. */
#define PLAN_MAGIC 0x5048414d /* "MAHP" */
#define PLAN_VERSION 2
#define MAX_OUTPUTS 4 /* spec.PLUGIN_OUTPUTS: output, present_key, present_value, qk */
#define MAX_RANK 8
#define MAX_ARGUMENT_BYTES 4096
#define MAX_ARGUMENTS 512
#define TENSOR_MAP_BYTES 128
/* SPACE_STICKY: a shared buffer's sticky report words (error_words), bound only while ORT captures a graph: an
 * eager call reports through its own status words (STEP_CHECK_STATUS), a replayed graph through these. */
enum { SPACE_NULL = 0, SPACE_INPUT = 1, SPACE_OUTPUT = 2, SPACE_SCRATCH = 3, SPACE_STICKY = 4 };
enum { STEP_LAUNCH = 1, STEP_GEMM = 2, STEP_COPY = 3, STEP_FILL = 4, STEP_CHECK_STATUS = 5 };
enum { STEP_LAUNCH_PROGRAMMATIC = 6 }; /* in a plan's words: a STEP_LAUNCH with ``programmatic`` set */
#define MAX_INPUTS 10 /* spec.PLUGIN_INPUTS: the eight of ORT's MultiHeadAttention, past_sequence_length, cache_indirection */
#define STATUS_WORDS 8 /* kernels/shared_buffer.cu STATUS_WORDS: code, a, b, c, site */

typedef struct {
  int64_t space, index, add;
} Ref;

typedef struct {
  int64_t offset;
  Ref ref;
} Patch;

typedef struct {
  int64_t offset, dtype, rank, interleave, swizzle, l2, oob;
  uint64_t dims[5], strides[4];
  uint32_t box[5], element_strides[5];
  Ref ref;
} MapPatch;

typedef struct {
  int64_t kind;
  /* launch (programmatic: with programmatic stream serialization, where the driver has cuLaunchKernelEx) */
  void* function;
  int64_t programmatic;
  unsigned grid[3], block[3], shared;
  int64_t blob_bytes, n_args, n_patches, n_maps;
  unsigned char* blob;
  int64_t* arg_offsets;
  Patch* patches;
  MapPatch* maps;
  /* gemm */
  int64_t trans_a, trans_b, m, n, k, a_type, lda, stride_a, b_type, ldb, stride_b, ldc, stride_c, batch, compute;
  float alpha;
  Ref a, b, c;
  /* copy, fill; check status (dst: the status words) */
  Ref dst, src;
  int64_t nbytes, byte, beams;
} Step;

typedef struct Plan {
  atomic_long refs;
  struct Plan* next;
  uint64_t hash;
  int64_t key_length;
  int64_t* key;
  int64_t scratch_bytes, output_alignment;
  int64_t output_rank[MAX_OUTPUTS];
  int64_t output_dims[MAX_OUTPUTS][MAX_RANK];
  int64_t n_steps;
  Step* steps;
  atomic_int ahead; /* made ahead of its first call (add_plan: mha_ep/native/ahead.py) and not yet used */
} Plan;

void free_plan(Plan* plan);
void release_plan(Plan* plan);
Plan* parse_plan(const int64_t* words, int64_t count, char* error, size_t error_size);
int set_plan_key(Plan* plan, const int64_t* key, int64_t length, uint64_t hash);

/* The process-wide plan cache, keyed on a call signature: (kernel config, device, flags) then per supplied input
 * slot (slot, element type, rank, dims..., alignment log2) (append_slot_key). */
#define MAX_KEY (4 + MAX_INPUTS * (4 + MAX_RANK))
extern atomic_llong g_hits, g_misses;
uint64_t hash_key(const int64_t* key, int64_t length);
int64_t append_slot_key(int64_t* key, int64_t length, int slot, int64_t type, size_t rank, const int64_t* dims,
                        int alignment_log2);
Plan* lookup_plan(const int64_t* key, int64_t length, uint64_t hash);
Plan* insert_plan(Plan* plan);
void note_hit(Plan* plan);

/* ----------------------------------------------------------------------- the Python side (python_side.c) */
extern PyObject* g_describe;    /* describe_kernel(attributes: dict, ep: str) -> (config id, node name) */
extern PyObject* g_planner;     /* plan(config id, node name, device, flags, inputs) -> bytes | (code, str) */
extern PyObject* g_cpu_compute; /* compute(config id, node name, inputs, token) -> None | (code, str) */
extern PyObject* g_attributes;  /* ((name, kind), ...): the attributes a kernel reads from its node */

OrtStatus* status_from_python_error(const char* node, const char* what);
OrtStatus* status_from_result(PyObject* result, const char* node, const char* what);
int enter_python(void);
void leave_python(void);

/* ----------------------------------------------------------------------------- the kernels (custom_op.c) */
enum { EP_CPU = 0, EP_CUDA = 1 };

/* The ops of the domain mha_ep: MultiHeadAttention (MAX_INPUTS inputs, MAX_OUTPUTS outputs, placeholders where
 * absent) and DecodeMatMul (x, weight_nk -> y: a decoder step's weight product, written by mha-ep static-cache). */
enum { OP_MHA = 0, OP_MATMUL = 1 };
#define MATMUL_INPUTS 2
#define MATMUL_OUTPUTS 1

typedef struct {
  int ep;
  int op;          /* OP_MHA | OP_MATMUL */
  const char* op_name;
  int n_inputs, n_outputs;
  long config;
  char node[512];
  uint32_t supplied; /* bit i: input slot i carries a real tensor (not a placeholder) */
  int device;
  OrtAllocator* allocator; /* CUDA: the provider's device allocator (scratch is freed through it) */
  const OrtMemoryInfo* memory;
  CUcontext context;
} Kernel;

/* ----------------------------------------------------------------------------- reading inputs (inputs.c) */
typedef struct {
  void* data;
  int type;
  size_t rank;
  int64_t dims[MAX_RANK];
} Tensor;

OrtStatus* read_input(OrtKernelContext* context, size_t slot, Tensor* t, const char* node);
int alignment_log2(const void* pointer);
PyObject* inputs_tuple(const Kernel* k, const Tensor* tensors, int with_data);

/* --------------------------------------------------------------- compute (cpu_compute.c, cuda_compute.c) */
OrtStatus* compute_cpu(Kernel* k, OrtKernelContext* context);
OrtStatus* compute_cuda(Kernel* k, OrtKernelContext* context);

/* ----------------------------------------------------- the module's methods (module.c holds their table) */
/* Each is defined beside what it serves (the file named). */
PyObject* py_configure(PyObject* self, PyObject* args);          /* python_side.c */
PyObject* py_shutdown(PyObject* self, PyObject* args);           /* python_side.c */
PyObject* py_check_plan(PyObject* self, PyObject* args);         /* plans.c */
PyObject* py_stats(PyObject* self, PyObject* args);              /* plans.c */
PyObject* py_clear_plans(PyObject* self, PyObject* args);        /* plans.c */
PyObject* py_signature_key(PyObject* self, PyObject* args);      /* plans.c */
PyObject* py_add_plan(PyObject* self, PyObject* args);           /* plans.c */
PyObject* py_has_plan(PyObject* self, PyObject* args);           /* plans.c */
PyObject* py_kernel_output(PyObject* self, PyObject* args);      /* cpu_compute.c */
PyObject* py_error_words(PyObject* self, PyObject* args);        /* reports.c */
PyObject* py_take_device_error(PyObject* self, PyObject* args);  /* reports.c */
PyObject* py_device_error_text(PyObject* self, PyObject* args);  /* reports.c */
PyObject* py_launch_copies(PyObject* self, PyObject* const* args, Py_ssize_t nargs); /* replay.c */
PyObject* py_driver_error(PyObject* self, PyObject* args);       /* replay.c */

#endif /* MHA_EP_NATIVE_H */
