/* mha_ep._native: the native route's custom-op library (mha_ep/native/__init__.py tells the story).
 *
 * One shared object plays two parts:
 *   - a CPython extension module (`import mha_ep._native`): the Python side configures it, and the CPU kernels'
 *     compute calls back into Python;
 *   - an ONNX Runtime custom-op library: SessionOptions.register_custom_ops_library(<this file>) makes ORT call
 *     RegisterCustomOps, which adds the domain `mha_ep` with MultiHeadAttention kernels for the CPU execution
 *     provider and, when the options ask for it, for CUDAExecutionProvider. ORT opens the same file Python
 *     loaded, so both parts share this file's globals.
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
 * ABI below is declared here, pinned to OrtApi version ORT_API_USED (ordinals are positions in struct OrtApi of
 * onnxruntime_c_api.h, which is append-only), and libcuda / libcublas are opened with dlopen when a CUDA kernel is
 * first created. Nothing here aborts the process: every failure is an OrtStatus (or a Python exception).
 */
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

/* ------------------------------------------------------------------------------------ the ORT ABI subset */
#define ORT_API_USED 18 /* KernelContext_GetScratchBuffer and KernelInfoGetAllocator: ORT 1.18 */
#define OP_VERSION 18

typedef struct OrtStatus OrtStatus;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtMemoryInfo OrtMemoryInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef struct OrtApi OrtApi;

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

typedef struct OrtAllocator {
  uint32_t version;
  void* (*Alloc)(struct OrtAllocator* self, size_t size);
  void (*Free)(struct OrtAllocator* self, void* p);
  const OrtMemoryInfo* (*Info)(const struct OrtAllocator* self);
} OrtAllocator;

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, ORT_RUNTIME_EXCEPTION = 6, ORT_EP_FAIL = 11 };
enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT32 = 6, ELEM_INT64 = 7, ELEM_FLOAT16 = 10, ELEM_BFLOAT16 = 16 };
enum { CHARACTERISTIC_REQUIRED = 0 };
enum { MEM_TYPE_DEFAULT = 0 };

/* struct OrtCustomOp, field for field (onnxruntime_c_api.h; fields after GetVariadicOutputHomogeneity were added
 * in versions 16-18 and are read by ORT only for ops of those versions). */
typedef struct OrtCustomOp OrtCustomOp;
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  int (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  int (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp* op, OrtShapeInferContext* context);
  int (*GetStartVersion)(const OrtCustomOp* op);
  int (*GetEndVersion)(const OrtCustomOp* op);
  size_t (*GetMayInplace)(int** input_index, int** output_index);
  void (*ReleaseMayInplace)(int* input_index, int* output_index);
  size_t (*GetAliasMap)(int** input_index, int** output_index);
  void (*ReleaseAliasMap)(int* input_index, int* output_index);
};

/* OrtApi ordinals used (tests/native/test_native_abi.py holds the same table, read off onnxruntime_c_api.h of API version 29,
 * and compares the two through ordinals()). */
enum {
  API_CreateStatus = 0,
  API_GetErrorMessage = 2,
  API_CreateCustomOpDomain = 26,
  API_CustomOpDomain_Add = 27,
  API_AddCustomOpDomain = 28,
  API_GetTensorMutableData = 51,
  API_GetTensorElementType = 60,
  API_GetDimensionsCount = 61,
  API_GetDimensions = 62,
  API_GetTensorTypeAndShape = 65,
  API_MemoryInfoGetId = 72,
  API_KernelInfoGetAttribute_float = 85,
  API_KernelInfoGetAttribute_int64 = 86,
  API_KernelInfoGetAttribute_string = 87,
  API_KernelContext_GetInputCount = 88,
  API_KernelContext_GetOutputCount = 89,
  API_KernelContext_GetInput = 90,
  API_KernelContext_GetOutput = 91,
  API_ReleaseStatus = 93,
  API_ReleaseTensorTypeAndShapeInfo = 99,
  API_ReleaseAllocator = 132,
  API_KernelContext_GetGPUComputeStream = 193,
  API_GetSessionConfigEntry = 238,
  API_KernelInfo_GetNodeName = 244,
  API_KernelContext_GetResource = 265,
  API_KernelContext_GetScratchBuffer = 277,
  API_KernelInfoGetAllocator = 278,
};

static const OrtApi* g_api = NULL;
#define API(type, ordinal) ((type)(((void* const*)g_api)[ordinal]))

typedef OrtStatus* (*CreateStatusFn)(int, const char*);
typedef const char* (*GetErrorMessageFn)(const OrtStatus*);
typedef void (*ReleaseStatusFn)(OrtStatus*);
typedef OrtStatus* (*CreateCustomOpDomainFn)(const char*, OrtCustomOpDomain**);
typedef OrtStatus* (*CustomOpDomain_AddFn)(OrtCustomOpDomain*, const OrtCustomOp*);
typedef OrtStatus* (*AddCustomOpDomainFn)(OrtSessionOptions*, OrtCustomOpDomain*);
typedef OrtStatus* (*GetTensorMutableDataFn)(OrtValue*, void**);
typedef OrtStatus* (*GetTensorElementTypeFn)(const OrtTensorTypeAndShapeInfo*, int*);
typedef OrtStatus* (*GetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo*, size_t*);
typedef OrtStatus* (*GetDimensionsFn)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t);
typedef OrtStatus* (*GetTensorTypeAndShapeFn)(const OrtValue*, OrtTensorTypeAndShapeInfo**);
typedef OrtStatus* (*MemoryInfoGetIdFn)(const OrtMemoryInfo*, int*);
typedef OrtStatus* (*GetAttrFloatFn)(const OrtKernelInfo*, const char*, float*);
typedef OrtStatus* (*GetAttrInt64Fn)(const OrtKernelInfo*, const char*, int64_t*);
typedef OrtStatus* (*GetAttrStringFn)(const OrtKernelInfo*, const char*, char*, size_t*);
typedef OrtStatus* (*GetCountFn)(const OrtKernelContext*, size_t*);
typedef OrtStatus* (*GetInputFn)(const OrtKernelContext*, size_t, const OrtValue**);
typedef OrtStatus* (*GetOutputFn)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);
typedef void (*ReleaseInfoFn)(OrtTensorTypeAndShapeInfo*);
typedef void (*ReleaseAllocatorFn)(OrtAllocator*);
typedef OrtStatus* (*GetStreamFn)(const OrtKernelContext*, void**);
typedef OrtStatus* (*GetSessionConfigEntryFn)(const OrtSessionOptions*, const char*, char*, size_t*);
typedef OrtStatus* (*GetNodeNameFn)(const OrtKernelInfo*, char*, size_t*);
typedef OrtStatus* (*GetResourceFn)(const OrtKernelContext*, int, int, void**);
typedef OrtStatus* (*GetScratchBufferFn)(const OrtKernelContext*, const OrtMemoryInfo*, size_t, void**);
typedef OrtStatus* (*KernelInfoGetAllocatorFn)(const OrtKernelInfo*, int, OrtAllocator**);

#define CUDA_RESOURCE_VERSION 1 /* core/providers/cuda/cuda_resource.h: version 1 already had the cuBLAS handle */
#define CUDA_RESOURCE_CUBLAS_HANDLE 10002

static OrtStatus* make_status(int code, const char* format, ...) {
  char message[2048];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);
  va_end(args);
  return API(CreateStatusFn, API_CreateStatus)(code, message);
}

static void release_status(OrtStatus* status) {
  if (status != NULL) API(ReleaseStatusFn, API_ReleaseStatus)(status);
}

/* ORT's status as text for one of our messages, released. */
static void status_text(OrtStatus* status, char* out, size_t size) {
  snprintf(out, size, "%s", API(GetErrorMessageFn, API_GetErrorMessage)(status));
  release_status(status);
}

/* ------------------------------------------------------------------------------------- the CUDA libraries */
typedef int CUresult;
typedef void* CUcontext;
typedef void* CUfunction;
typedef void* CUstream;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

static struct {
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
} cu;

static struct {
  int tried;
  void* library;
  char error[512];
  int (*gemm)(void*, int, int, int, int, int, const void*, const void*, int, int, long long, const void*, int, int,
              long long, const void*, void*, int, int, long long, int, int, int);
} cublas;

static pthread_mutex_t g_library_lock = PTHREAD_MUTEX_INITIALIZER;

static void* symbol(void* library, const char* name, const char* fallback) {
  void* found = dlsym(library, name);
  if (found == NULL && fallback != NULL) found = dlsym(library, fallback);
  return found;
}

/* 1 when libcuda is loaded (cu.error says why not otherwise). */
static int load_cuda(void) {
  pthread_mutex_lock(&g_library_lock);
  if (cu.loaded == 0) {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
      snprintf(cu.error, sizeof cu.error, "the CUDA driver (libcuda.so.1) could not be loaded: %s", dlerror());
      cu.loaded = -1;
    } else {
#define CU_SYMBOL(field, name, fallback) *(void**)&cu.field = symbol(library, name, fallback)
      CU_SYMBOL(cuInit, "cuInit", NULL);
      CU_SYMBOL(cuDeviceGet, "cuDeviceGet", NULL);
      CU_SYMBOL(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL);
      CU_SYMBOL(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
      CU_SYMBOL(cuCtxGetCurrent, "cuCtxGetCurrent", NULL);
      CU_SYMBOL(cuCtxSetCurrent, "cuCtxSetCurrent", NULL);
      CU_SYMBOL(cuGetErrorString, "cuGetErrorString", NULL);
      CU_SYMBOL(cuLaunchKernel, "cuLaunchKernel", NULL);
      CU_SYMBOL(cuMemcpyAsync, "cuMemcpyAsync", NULL);
      CU_SYMBOL(cuMemsetD8Async, "cuMemsetD8Async", NULL);
      CU_SYMBOL(cuTensorMapEncodeTiled, "cuTensorMapEncodeTiled", NULL);
      CU_SYMBOL(cuStreamIsCapturing, "cuStreamIsCapturing", NULL);
      CU_SYMBOL(cuStreamSynchronize, "cuStreamSynchronize", NULL);
      CU_SYMBOL(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync");
      CU_SYMBOL(cuMemAlloc, "cuMemAlloc_v2", "cuMemAlloc");
      CU_SYMBOL(cuMemcpyDtoH, "cuMemcpyDtoH_v2", "cuMemcpyDtoH");
      CU_SYMBOL(cuMemsetD8, "cuMemsetD8_v2", "cuMemsetD8");
      CU_SYMBOL(cuEventRecord, "cuEventRecord", NULL);
      CU_SYMBOL(cuStreamWaitEvent, "cuStreamWaitEvent", NULL);
#undef CU_SYMBOL
      if (!cu.cuInit || !cu.cuDeviceGet || !cu.cuDevicePrimaryCtxRetain || !cu.cuCtxGetCurrent ||
          !cu.cuCtxSetCurrent || !cu.cuGetErrorString || !cu.cuLaunchKernel || !cu.cuMemcpyAsync ||
          !cu.cuMemsetD8Async) {
        snprintf(cu.error, sizeof cu.error, "the CUDA driver (libcuda.so.1) lacks a function mha_ep launches with");
        cu.loaded = -1;
      } else if (cu.cuInit(0) != 0) {
        snprintf(cu.error, sizeof cu.error, "cuInit failed: no usable CUDA device");
        cu.loaded = -1;
      } else {
        cu.loaded = 1;
      }
    }
  }
  int loaded = cu.loaded;
  pthread_mutex_unlock(&g_library_lock);
  return loaded == 1;
}

/* 1 when cuBLAS's strided-batched GemmEx is found (the copy ORT's CUDA provider loaded; cublas.error otherwise). */
static int load_cublas(void) {
  pthread_mutex_lock(&g_library_lock);
  if (!cublas.tried) {
    cublas.tried = 1;
    const char* names[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so"};
    for (size_t i = 0; i < sizeof names / sizeof names[0] && cublas.library == NULL; ++i) {
      cublas.library = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    }
    if (cublas.library == NULL) {
      snprintf(cublas.error, sizeof cublas.error, "cuBLAS (libcublas.so.13 or .12) could not be loaded: %s",
               dlerror());
    } else {
      *(void**)&cublas.gemm = dlsym(cublas.library, "cublasGemmStridedBatchedEx");
      if (cublas.gemm == NULL) snprintf(cublas.error, sizeof cublas.error, "cuBLAS lacks cublasGemmStridedBatchedEx");
    }
  }
  int ok = cublas.gemm != NULL;
  pthread_mutex_unlock(&g_library_lock);
  return ok;
}

static const char* cu_error_text(CUresult result) {
  const char* text = NULL;
  if (cu.cuGetErrorString == NULL || cu.cuGetErrorString(result, &text) != 0 || text == NULL) return "unknown";
  return text;
}

/* The sticky report words of each device (STATUS_WORDS int32 of device memory), allocated once by error_words (the
 * planner calls it, before ORT could capture a graph) and kept for the life of the process: captured graphs hold
 * their address. take_device_error reads and clears them. */
#define MAX_DEVICES 64
static CUdeviceptr g_error_device[MAX_DEVICES];

/* ------------------------------------------------------------------------------------------------- plans */
/* The encoded plan (mha_ep/native/plan.py encode_plan) is a sequence of little-endian int64 words. */
#define PLAN_MAGIC 0x5048414d /* "MAHP" */
#define PLAN_VERSION 2
#define MAX_OUTPUTS 4 /* spec.PLUGIN_OUTPUTS: output, present_key, present_value, qk */
#define MAX_RANK 8
#define MAX_ARGUMENT_BYTES 4096
#define MAX_ARGUMENTS 512
#define MAX_PLANS 4096
#define TENSOR_MAP_BYTES 128
/* SPACE_STICKY: a shared buffer's sticky report words (error_words), bound only while ORT captures a graph: an
 * eager call reports through its own status words (STEP_CHECK_STATUS), a replayed graph through these. */
enum { SPACE_NULL = 0, SPACE_INPUT = 1, SPACE_OUTPUT = 2, SPACE_SCRATCH = 3, SPACE_STICKY = 4 };
enum { STEP_LAUNCH = 1, STEP_GEMM = 2, STEP_COPY = 3, STEP_FILL = 4, STEP_CHECK_STATUS = 5 };
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
  /* launch */
  void* function;
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
} Plan;

static void free_plan(Plan* plan) {
  if (plan == NULL) return;
  for (int64_t i = 0; plan->steps != NULL && i < plan->n_steps; ++i) {
    Step* s = &plan->steps[i];
    free(s->blob);
    free(s->arg_offsets);
    free(s->patches);
    free(s->maps);
  }
  free(plan->steps);
  free(plan->key);
  free(plan);
}

static void release_plan(Plan* plan) {
  if (plan != NULL && atomic_fetch_sub(&plan->refs, 1) == 1) free_plan(plan);
}

typedef struct {
  const int64_t* words;
  int64_t count, at;
  char error[256];
} Reader;

static int next_word(Reader* r, int64_t* out) {
  if (r->at >= r->count) {
    snprintf(r->error, sizeof r->error, "the plan ends early (word %lld)", (long long)r->at);
    return 0;
  }
  *out = r->words[r->at++];
  return 1;
}

#define READ(r, target)                     \
  do {                                      \
    int64_t word_;                          \
    if (!next_word((r), &word_)) return 0;  \
    (target) = word_;                       \
  } while (0)

static int in_range(Reader* r, int64_t value, int64_t low, int64_t high, const char* what) {
  if (value < low || value > high) {
    snprintf(r->error, sizeof r->error, "plan field %s = %lld is outside [%lld, %lld]", what, (long long)value,
             (long long)low, (long long)high);
    return 0;
  }
  return 1;
}

static int read_ref(Reader* r, Ref* ref) {
  READ(r, ref->space);
  READ(r, ref->index);
  READ(r, ref->add);
  if (!in_range(r, ref->space, SPACE_NULL, SPACE_STICKY, "space")) return 0;
  int64_t limit = ref->space == SPACE_INPUT ? MAX_INPUTS - 1 : ref->space == SPACE_OUTPUT ? MAX_OUTPUTS - 1 : 0;
  return in_range(r, ref->index, 0, limit, "index") && in_range(r, ref->add, 0, INT64_MAX, "offset");
}

static int read_launch(Reader* r, Step* s) {
  int64_t function;
  READ(r, function);
  s->function = (void*)(uintptr_t)function;
  for (int i = 0; i < 3; ++i) {
    int64_t g;
    READ(r, g);
    if (!in_range(r, g, 1, 0x7fffffff, "grid")) return 0;
    s->grid[i] = (unsigned)g;
  }
  for (int i = 0; i < 3; ++i) {
    int64_t b;
    READ(r, b);
    if (!in_range(r, b, 1, 1024, "block")) return 0;
    s->block[i] = (unsigned)b;
  }
  int64_t shared;
  READ(r, shared);
  if (!in_range(r, shared, 0, 1 << 20, "shared")) return 0;
  s->shared = (unsigned)shared;
  READ(r, s->blob_bytes);
  if (!in_range(r, s->blob_bytes, 0, MAX_ARGUMENT_BYTES, "argument bytes")) return 0;
  READ(r, s->n_args);
  if (!in_range(r, s->n_args, 0, MAX_ARGUMENTS, "arguments")) return 0;
  s->arg_offsets = calloc((size_t)s->n_args + 1, sizeof(int64_t));
  if (s->arg_offsets == NULL) return 0;
  for (int64_t i = 0; i < s->n_args; ++i) {
    READ(r, s->arg_offsets[i]);
    if (!in_range(r, s->arg_offsets[i], 0, s->blob_bytes - 1, "argument offset")) return 0;
  }
  READ(r, s->n_patches);
  if (!in_range(r, s->n_patches, 0, MAX_ARGUMENT_BYTES / 8, "patches")) return 0;
  s->patches = calloc((size_t)s->n_patches + 1, sizeof(Patch));
  if (s->patches == NULL) return 0;
  for (int64_t i = 0; i < s->n_patches; ++i) {
    READ(r, s->patches[i].offset);
    if (!in_range(r, s->patches[i].offset, 0, s->blob_bytes - 8, "patch offset")) return 0;
    if (!read_ref(r, &s->patches[i].ref)) return 0;
  }
  READ(r, s->n_maps);
  if (!in_range(r, s->n_maps, 0, 8, "tensor maps")) return 0;
  s->maps = calloc((size_t)s->n_maps + 1, sizeof(MapPatch));
  if (s->maps == NULL) return 0;
  for (int64_t i = 0; i < s->n_maps; ++i) {
    MapPatch* m = &s->maps[i];
    READ(r, m->offset);
    if (!in_range(r, m->offset, 0, s->blob_bytes - TENSOR_MAP_BYTES, "tensor map offset")) return 0;
    if (m->offset % 64) {
      snprintf(r->error, sizeof r->error, "tensor map offset %lld is not 64-byte aligned", (long long)m->offset);
      return 0;
    }
    READ(r, m->dtype);
    READ(r, m->rank);
    if (!in_range(r, m->rank, 1, 5, "tensor map rank")) return 0;
    for (int64_t d = 0; d < m->rank; ++d) READ(r, m->dims[d]);
    for (int64_t d = 0; d + 1 < m->rank; ++d) READ(r, m->strides[d]);
    for (int64_t d = 0; d < m->rank; ++d) READ(r, m->box[d]);
    for (int64_t d = 0; d < m->rank; ++d) READ(r, m->element_strides[d]);
    READ(r, m->interleave);
    READ(r, m->swizzle);
    READ(r, m->l2);
    READ(r, m->oob);
    if (!read_ref(r, &m->ref)) return 0;
  }
  int64_t words = (s->blob_bytes + 7) / 8;
  s->blob = calloc((size_t)words + 1, 8);
  if (s->blob == NULL) return 0;
  for (int64_t i = 0; i < words; ++i) {
    int64_t word;
    READ(r, word);
    memcpy(s->blob + 8 * i, &word, 8);
  }
  return 1;
}

static int read_gemm(Reader* r, Step* s) {
  int64_t alpha_bits;
  READ(r, s->trans_a);
  READ(r, s->trans_b);
  READ(r, s->m);
  READ(r, s->n);
  READ(r, s->k);
  READ(r, alpha_bits);
  uint32_t bits = (uint32_t)alpha_bits;
  memcpy(&s->alpha, &bits, 4);
  if (!read_ref(r, &s->a)) return 0;
  READ(r, s->a_type);
  READ(r, s->lda);
  READ(r, s->stride_a);
  if (!read_ref(r, &s->b)) return 0;
  READ(r, s->b_type);
  READ(r, s->ldb);
  READ(r, s->stride_b);
  if (!read_ref(r, &s->c)) return 0;
  READ(r, s->ldc);
  READ(r, s->stride_c);
  READ(r, s->batch);
  READ(r, s->compute);
  return 1;
}

/* Parse an encoded plan; NULL with r->error set when it is malformed. */
static Plan* parse_plan(const int64_t* words, int64_t count, char* error, size_t error_size) {
  Reader r = {words, count, 0, {0}};
  Plan* plan = calloc(1, sizeof(Plan));
  if (plan == NULL) {
    snprintf(error, error_size, "out of host memory");
    return NULL;
  }
  atomic_init(&plan->refs, 1);
  int64_t magic = 0, version = 0, outputs = 0;
  int ok = next_word(&r, &magic) && next_word(&r, &version);
  if (ok && (magic != PLAN_MAGIC || version != PLAN_VERSION)) {
    snprintf(r.error, sizeof r.error, "not a plan of version %d", PLAN_VERSION);
    ok = 0;
  }
  ok = ok && next_word(&r, &plan->scratch_bytes) && in_range(&r, plan->scratch_bytes, 0, INT64_MAX, "scratch");
  ok = ok && next_word(&r, &plan->output_alignment) && in_range(&r, plan->output_alignment, 1, 4096, "alignment");
  ok = ok && next_word(&r, &outputs) && in_range(&r, outputs, MAX_OUTPUTS, MAX_OUTPUTS, "outputs");
  for (int o = 0; ok && o < MAX_OUTPUTS; ++o) {
    ok = next_word(&r, &plan->output_rank[o]) && in_range(&r, plan->output_rank[o], 0, MAX_RANK, "rank");
    for (int64_t d = 0; ok && d < plan->output_rank[o]; ++d) {
      ok = next_word(&r, &plan->output_dims[o][d]) && in_range(&r, plan->output_dims[o][d], 0, INT64_MAX, "dim");
    }
  }
  ok = ok && next_word(&r, &plan->n_steps) && in_range(&r, plan->n_steps, 0, 4096, "steps");
  if (ok) {
    plan->steps = calloc((size_t)plan->n_steps + 1, sizeof(Step));
    ok = plan->steps != NULL;
  }
  for (int64_t i = 0; ok && i < plan->n_steps; ++i) {
    Step* s = &plan->steps[i];
    ok = next_word(&r, &s->kind);
    if (!ok) break;
    switch (s->kind) {
      case STEP_LAUNCH:
        ok = read_launch(&r, s);
        break;
      case STEP_GEMM:
        ok = read_gemm(&r, s);
        break;
      case STEP_COPY:
        ok = read_ref(&r, &s->dst) && read_ref(&r, &s->src) && next_word(&r, &s->nbytes) &&
             in_range(&r, s->nbytes, 0, INT64_MAX, "bytes");
        break;
      case STEP_FILL:
        ok = read_ref(&r, &s->dst) && next_word(&r, &s->byte) && next_word(&r, &s->nbytes) &&
             in_range(&r, s->byte, 0, 255, "byte") && in_range(&r, s->nbytes, 0, INT64_MAX, "bytes");
        break;
      case STEP_CHECK_STATUS:
        ok = read_ref(&r, &s->dst) && next_word(&r, &s->beams) && in_range(&r, s->beams, 0, 0x7fffffff, "beams");
        break;
      default:
        snprintf(r.error, sizeof r.error, "unknown step kind %lld", (long long)s->kind);
        ok = 0;
    }
  }
  if (ok && r.at != r.count) {
    snprintf(r.error, sizeof r.error, "%lld words after the last step", (long long)(r.count - r.at));
    ok = 0;
  }
  if (!ok) {
    snprintf(error, error_size, "mha_ep native plan: %s", r.error[0] ? r.error : "out of host memory");
    free_plan(plan);
    return NULL;
  }
  return plan;
}

/* The process-wide plan cache: call signature -> plan, shared by every kernel of every session. */
#define BUCKETS 1024
static Plan* g_buckets[BUCKETS];
static int64_t g_plan_count = 0;
static pthread_mutex_t g_plan_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_llong g_hits, g_misses, g_evictions;

static uint64_t hash_key(const int64_t* key, int64_t length) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0; i < length; ++i) {
    h ^= (uint64_t)key[i];
    h *= 1099511628211ull;
    h ^= h >> 29;
  }
  return h;
}

static Plan* lookup_plan(const int64_t* key, int64_t length, uint64_t hash) {
  Plan* found = NULL;
  pthread_mutex_lock(&g_plan_lock);
  for (Plan* p = g_buckets[hash % BUCKETS]; p != NULL; p = p->next) {
    if (p->hash == hash && p->key_length == length && memcmp(p->key, key, (size_t)length * 8) == 0) {
      atomic_fetch_add(&p->refs, 1);
      found = p;
      break;
    }
  }
  pthread_mutex_unlock(&g_plan_lock);
  return found;
}

static void clear_plans_locked(void) {
  for (int b = 0; b < BUCKETS; ++b) {
    Plan* p = g_buckets[b];
    while (p != NULL) {
      Plan* next = p->next;
      release_plan(p);
      p = next;
    }
    g_buckets[b] = NULL;
  }
  g_plan_count = 0;
}

/* Insert ``plan`` (which holds one reference for the caller) unless an equal key is there already; returns the
 * plan to use, with one reference for the caller. */
static Plan* insert_plan(Plan* plan) {
  pthread_mutex_lock(&g_plan_lock);
  for (Plan* p = g_buckets[plan->hash % BUCKETS]; p != NULL; p = p->next) {
    if (p->hash == plan->hash && p->key_length == plan->key_length &&
        memcmp(p->key, plan->key, (size_t)plan->key_length * 8) == 0) {
      atomic_fetch_add(&p->refs, 1);
      pthread_mutex_unlock(&g_plan_lock);
      release_plan(plan);
      return p;
    }
  }
  if (g_plan_count >= MAX_PLANS) {
    clear_plans_locked(); /* plans in use stay alive through their references */
    atomic_fetch_add(&g_evictions, 1);
  }
  atomic_fetch_add(&plan->refs, 1); /* the cache's reference */
  plan->next = g_buckets[plan->hash % BUCKETS];
  g_buckets[plan->hash % BUCKETS] = plan;
  ++g_plan_count;
  pthread_mutex_unlock(&g_plan_lock);
  return plan;
}

/* ----------------------------------------------------------------------------------- the Python side */
static PyObject* g_describe = NULL;    /* describe_kernel(attributes: dict, ep: str) -> (config id, node name) */
static PyObject* g_planner = NULL;     /* plan(config id, node name, device, flags, inputs) -> bytes | (code, str) */
static PyObject* g_cpu_compute = NULL; /* compute(config id, node name, inputs, token) -> None | (code, str) */
static PyObject* g_attributes = NULL;  /* ((name, kind), ...): the attributes a kernel reads from its node */
static atomic_int g_finalizing = 0;

static __thread OrtKernelContext* t_active_context = NULL; /* the CPU compute callback's context on this thread */

/* The pending Python exception as an ORT status (the exception is cleared). A KeyboardInterrupt is put back as a
 * pending interrupt, so that the caller's thread sees it once ORT's run has returned. Call with the GIL. */
static OrtStatus* status_from_python_error(const char* node, const char* what) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  int interrupted = type != NULL && PyErr_GivenExceptionMatches(type, PyExc_KeyboardInterrupt);
  PyObject* text = value != NULL ? PyObject_Str(value) : NULL;
  const char* message = text != NULL ? PyUnicode_AsUTF8AndSize(text, NULL) : NULL;
  if (message == NULL) {
    PyErr_Clear();
    message = "(the error could not be read)";
  }
  PyObject* type_object = type != NULL ? PyObject_GetAttrString(type, "__name__") : NULL;
  const char* type_name = type_object != NULL ? PyUnicode_AsUTF8AndSize(type_object, NULL) : NULL;
  if (type_name == NULL) {
    PyErr_Clear();
    type_name = "error";
  }
  OrtStatus* status = interrupted
                          ? make_status(ORT_FAIL, "mha_ep MultiHeadAttention node '%s': interrupted (KeyboardInterrupt)", node)
                          : make_status(ORT_FAIL, "mha_ep MultiHeadAttention node '%s': %s failed: %s: %s", node, what,
                                        type_name, message);
  Py_XDECREF(text);
  Py_XDECREF(type_object);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  if (interrupted) PyErr_SetInterrupt();
  return status;
}

/* A Python callback's answer: None (success), or (code, message) -> status. Call with the GIL. */
static OrtStatus* status_from_result(PyObject* result, const char* node, const char* what) {
  if (result == NULL) return status_from_python_error(node, what);
  if (result == Py_None) return NULL;
  int code = ORT_FAIL;
  const char* message = NULL;
  if (PyTuple_Check(result) && PyTuple_Size(result) == 2 && PyLong_Check(PyTuple_GetItem(result, 0)) &&
      PyUnicode_Check(PyTuple_GetItem(result, 1))) {
    code = (int)PyLong_AsLong(PyTuple_GetItem(result, 0));
    message = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(result, 1), NULL);
  }
  if (message == NULL) {
    PyErr_Clear();
    return make_status(ORT_FAIL, "mha_ep MultiHeadAttention node '%s': %s returned an unreadable answer", node, what);
  }
  return make_status(code, "%s", message);
}

/* Python is entered only between enter_python() and leave_python(). At exit (shutdown(), from atexit) no new entry
 * is let in, and the calls already inside are waited for with the GIL released: a thread that took or waited for
 * the GIL once finalization began would be ended by CPython with a forced unwind through ORT's frames, which
 * aborts the process ("FATAL: exception not rethrown"). */
static atomic_int g_inside_python = 0;

static int enter_python(void) {
  atomic_fetch_add(&g_inside_python, 1);
  if (!atomic_load(&g_finalizing) && Py_IsInitialized()) return 1;
  atomic_fetch_sub(&g_inside_python, 1);
  return 0;
}

static void leave_python(void) { atomic_fetch_sub(&g_inside_python, 1); }

/* ------------------------------------------------------------------------------------------- the kernels */
enum { EP_CPU = 0, EP_CUDA = 1 };

typedef struct {
  OrtCustomOp op;
  int ep, float_type, mask_type;
} OpVariant;

typedef struct {
  int ep;
  long config;
  char node[512];
  uint32_t supplied; /* bit i: input slot i carries a real tensor (not a placeholder) */
  int device;
  OrtAllocator* allocator; /* CUDA: the provider's device allocator (scratch is freed through it) */
  const OrtMemoryInfo* memory;
  CUcontext context;
} Kernel;

static const char* op_name(const OrtCustomOp* op) {
  (void)op;
  return "MultiHeadAttention";
}

static const char* op_provider(const OrtCustomOp* op) {
  return ((const OpVariant*)op)->ep == EP_CUDA ? "CUDAExecutionProvider" : NULL;
}

static int op_input_type(const OrtCustomOp* op, size_t index) {
  const OpVariant* v = (const OpVariant*)op;
  if (index == 4) return v->mask_type;
  return index == 8 || index == 9 ? ELEM_INT32 : v->float_type; /* past_sequence_length, cache_indirection */
}

static size_t op_input_count(const OrtCustomOp* op) {
  (void)op;
  return MAX_INPUTS;
}

static int op_output_type(const OrtCustomOp* op, size_t index) {
  (void)index;
  return ((const OpVariant*)op)->float_type;
}

static size_t op_output_count(const OrtCustomOp* op) {
  (void)op;
  return MAX_OUTPUTS;
}

static int op_characteristic(const OrtCustomOp* op, size_t index) {
  (void)op;
  (void)index;
  return CHARACTERISTIC_REQUIRED;
}

static int op_memory_type(const OrtCustomOp* op, size_t index) {
  (void)op;
  (void)index;
  return MEM_TYPE_DEFAULT;
}

static int op_min_arity(const OrtCustomOp* op) {
  (void)op;
  return 1;
}

static int op_homogeneity(const OrtCustomOp* op) {
  (void)op;
  return 1;
}

static int op_start_version(const OrtCustomOp* op) {
  (void)op;
  return 1;
}

static void kernel_destroy(void* opaque) {
  Kernel* k = opaque;
  if (k == NULL) return;
  if (k->allocator != NULL && g_api != NULL) API(ReleaseAllocatorFn, API_ReleaseAllocator)(k->allocator);
  CUdevice device;
  if (k->context != NULL && cu.cuDevicePrimaryCtxRelease != NULL && cu.cuDeviceGet(&device, k->device) == 0) {
    cu.cuDevicePrimaryCtxRelease(device);
  }
  free(k);
}

/* The node's attribute ``name`` of ``kind`` ("int", "float", "string") as a Python value, or NULL (with no
 * Python error) when the node lacks it. Call with the GIL. */
static PyObject* attribute_value(const OrtKernelInfo* info, const char* name, const char* kind) {
  OrtStatus* status;
  if (strcmp(kind, "int") == 0) {
    int64_t value = 0;
    status = API(GetAttrInt64Fn, API_KernelInfoGetAttribute_int64)(info, name, &value);
    if (status != NULL) {
      release_status(status);
      return NULL;
    }
    return PyLong_FromLongLong(value);
  }
  if (strcmp(kind, "float") == 0) {
    float value = 0;
    status = API(GetAttrFloatFn, API_KernelInfoGetAttribute_float)(info, name, &value);
    if (status != NULL) {
      release_status(status);
      return NULL;
    }
    return PyFloat_FromDouble(value);
  }
  size_t size = 0;
  status = API(GetAttrStringFn, API_KernelInfoGetAttribute_string)(info, name, NULL, &size);
  if (status != NULL) {
    release_status(status);
    return NULL;
  }
  char* text = malloc(size + 1);
  if (text == NULL) return PyErr_NoMemory();
  status = API(GetAttrStringFn, API_KernelInfoGetAttribute_string)(info, name, text, &size);
  if (status != NULL) {
    release_status(status);
    free(text);
    return NULL;
  }
  PyObject* value = PyBytes_FromStringAndSize(text, size > 0 ? (Py_ssize_t)size - 1 : 0); /* bytes: any encoding */
  free(text);
  return value;
}

static OrtStatus* describe_kernel(const OrtKernelInfo* info, Kernel* k) {
  if (g_describe == NULL || !enter_python()) {
    return make_status(ORT_FAIL, "mha_ep MultiHeadAttention: the mha_ep Python package is not ready (it was not "
                                 "imported, or the interpreter is shutting down)");
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  OrtStatus* status = NULL;
  PyObject* attributes = PyDict_New();
  PyObject* result = NULL;
  if (attributes == NULL) goto python_error;
  Py_ssize_t count = PyTuple_Size(g_attributes);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* entry = PyTuple_GetItem(g_attributes, i);
    const char* name = entry ? PyUnicode_AsUTF8AndSize(PyTuple_GetItem(entry, 0), NULL) : NULL;
    const char* kind = entry ? PyUnicode_AsUTF8AndSize(PyTuple_GetItem(entry, 1), NULL) : NULL;
    if (name == NULL || kind == NULL) goto python_error;
    PyObject* value = attribute_value(info, name, kind);
    if (value == NULL) {
      if (PyErr_Occurred()) goto python_error;
      continue;
    }
    int failed = PyDict_SetItemString(attributes, name, value);
    Py_DECREF(value);
    if (failed) goto python_error;
  }
  result = PyObject_CallFunction(g_describe, "Os", attributes, k->ep == EP_CUDA ? "cuda" : "cpu");
  if (result == NULL) goto python_error;
  if (PyTuple_Check(result) && PyTuple_Size(result) == 3 && PyLong_Check(PyTuple_GetItem(result, 0))) {
    k->config = PyLong_AsLong(PyTuple_GetItem(result, 0));
    k->supplied = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GetItem(result, 1));
    const char* node = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(result, 2), NULL);
    if (node == NULL || PyErr_Occurred()) goto python_error;
    snprintf(k->node, sizeof k->node, "%s", node);
  } else {
    status = status_from_result(result, "", "reading the node's attributes");
    if (status == NULL) status = make_status(ORT_FAIL, "mha_ep MultiHeadAttention: describe_kernel answered nothing");
  }
  goto done;
python_error:
  status = status_from_python_error("", "reading the node's attributes");
done:
  Py_XDECREF(result);
  Py_XDECREF(attributes);
  PyGILState_Release(gil);
  leave_python();
  return status;
}

static OrtStatus* kernel_create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)api;
  *out = NULL;
  Kernel* k = calloc(1, sizeof(Kernel));
  if (k == NULL) return make_status(ORT_FAIL, "mha_ep MultiHeadAttention: out of host memory");
  k->ep = ((const OpVariant*)op)->ep;
  OrtStatus* status = describe_kernel(info, k);
  if (status == NULL && k->ep == EP_CUDA) {
    if (!load_cuda()) {
      status = make_status(ORT_EP_FAIL, "mha_ep MultiHeadAttention node '%s': %s", k->node, cu.error);
    } else {
      status = API(KernelInfoGetAllocatorFn, API_KernelInfoGetAllocator)(info, MEM_TYPE_DEFAULT, &k->allocator);
      if (status == NULL) {
        k->memory = k->allocator->Info(k->allocator);
        status = API(MemoryInfoGetIdFn, API_MemoryInfoGetId)(k->memory, &k->device);
      }
      CUdevice device;
      if (status == NULL && (cu.cuDeviceGet(&device, k->device) != 0 ||
                             cu.cuDevicePrimaryCtxRetain(&k->context, device) != 0)) {
        status = make_status(ORT_EP_FAIL, "mha_ep MultiHeadAttention node '%s': CUDA device %d has no context",
                             k->node, k->device);
      }
    }
  }
  if (status != NULL) {
    kernel_destroy(k);
    return status;
  }
  *out = k;
  return NULL;
}

/* -------------------------------------------------------------------------------------- reading inputs */
typedef struct {
  void* data;
  int type;
  size_t rank;
  int64_t dims[MAX_RANK];
} Tensor;

static OrtStatus* read_input(OrtKernelContext* context, size_t slot, Tensor* t, const char* node) {
  const OrtValue* value = NULL;
  OrtTensorTypeAndShapeInfo* info = NULL;
  OrtStatus* status = API(GetInputFn, API_KernelContext_GetInput)(context, slot, &value);
  if (status == NULL && value == NULL) {
    return make_status(ORT_INVALID_ARGUMENT, "mha_ep MultiHeadAttention node '%s': input %zu is missing", node, slot);
  }
  if (status == NULL) status = API(GetTensorTypeAndShapeFn, API_GetTensorTypeAndShape)(value, &info);
  if (status == NULL) status = API(GetTensorElementTypeFn, API_GetTensorElementType)(info, &t->type);
  if (status == NULL) status = API(GetDimensionsCountFn, API_GetDimensionsCount)(info, &t->rank);
  if (status == NULL && t->rank > MAX_RANK) {
    status = make_status(ORT_INVALID_ARGUMENT, "mha_ep MultiHeadAttention node '%s': input %zu has rank %zu, more "
                         "than %d", node, slot, t->rank, MAX_RANK);
  }
  if (status == NULL) status = API(GetDimensionsFn, API_GetDimensions)(info, t->dims, t->rank);
  if (info != NULL) API(ReleaseInfoFn, API_ReleaseTensorTypeAndShapeInfo)(info);
  if (status == NULL) status = API(GetTensorMutableDataFn, API_GetTensorMutableData)((OrtValue*)value, &t->data);
  return status;
}

static int alignment_log2(const void* pointer) {
  uintptr_t p = (uintptr_t)pointer;
  int log2 = 0;
  while (log2 < 8 && p && (p & 1) == 0) {
    p >>= 1;
    ++log2;
  }
  return p ? log2 : 8;
}

/* (type, dims, alignment log2) per slot, None for a placeholder, as a tuple. Call with the GIL. */
static PyObject* inputs_tuple(const Kernel* k, const Tensor* tensors, int with_data) {
  PyObject* inputs = PyTuple_New(MAX_INPUTS);
  if (inputs == NULL) return NULL;
  for (int slot = 0; slot < MAX_INPUTS; ++slot) {
    PyObject* entry;
    if (!(k->supplied & (1u << slot))) {
      entry = Py_None;
      Py_INCREF(entry);
    } else {
      const Tensor* t = &tensors[slot];
      PyObject* dims = PyTuple_New((Py_ssize_t)t->rank);
      if (dims == NULL) {
        Py_DECREF(inputs);
        return NULL;
      }
      for (size_t d = 0; d < t->rank; ++d) PyTuple_SetItem(dims, (Py_ssize_t)d, PyLong_FromLongLong(t->dims[d]));
      if (with_data) {
        entry = Py_BuildValue("(iNK)", t->type, dims, (unsigned long long)(uintptr_t)t->data);
      } else {
        entry = Py_BuildValue("(iNi)", t->type, dims, alignment_log2(t->data));
      }
      if (entry == NULL) {
        Py_DECREF(inputs);
        return NULL;
      }
    }
    PyTuple_SetItem(inputs, slot, entry);
  }
  return inputs;
}

/* ------------------------------------------------------------------------------------------ CPU compute */
static OrtStatus* compute_cpu(Kernel* k, OrtKernelContext* context) {
  Tensor tensors[MAX_INPUTS];
  memset(tensors, 0, sizeof tensors);
  for (int slot = 0; slot < MAX_INPUTS; ++slot) {
    if (!(k->supplied & (1u << slot))) continue;
    OrtStatus* status = read_input(context, (size_t)slot, &tensors[slot], k->node);
    if (status != NULL) return status;
  }
  if (g_cpu_compute == NULL || !enter_python()) {
    return make_status(ORT_FAIL, "mha_ep MultiHeadAttention node '%s': the interpreter is shutting down", k->node);
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  OrtStatus* status;
  PyObject* inputs = inputs_tuple(k, tensors, 1);
  if (inputs == NULL) {
    status = status_from_python_error(k->node, "reading the inputs");
  } else {
    OrtKernelContext* previous = t_active_context;
    t_active_context = context;
    PyObject* result = PyObject_CallFunction(g_cpu_compute, "lsNK", k->config, k->node, inputs,
                                             (unsigned long long)(uintptr_t)context);
    t_active_context = previous;
    status = status_from_result(result, k->node, "the CPU compute");
    Py_XDECREF(result);
  }
  PyGILState_Release(gil);
  leave_python();
  return status;
}

/* ----------------------------------------------------------------------------------------- CUDA compute */
#define MAX_KEY (4 + MAX_INPUTS * (4 + MAX_RANK))

typedef struct {
  void* input[MAX_INPUTS];
  void* output[MAX_OUTPUTS];
  void* scratch;
  void* sticky; /* the device's sticky report words while ORT captures, else NULL */
} Bases;

static uint64_t resolve(const Bases* bases, Ref ref) {
  const void* base = NULL;
  switch (ref.space) {
    case SPACE_INPUT:
      base = bases->input[ref.index];
      break;
    case SPACE_OUTPUT:
      base = bases->output[ref.index];
      break;
    case SPACE_SCRATCH:
      base = bases->scratch;
      break;
    case SPACE_STICKY:
      return (uint64_t)(uintptr_t)bases->sticky; /* no offset: NULL stays NULL */
    default:
      return 0;
  }
  return (uint64_t)(uintptr_t)base + (uint64_t)ref.add;
}

static Plan* make_plan(const Kernel* k, const Tensor* tensors, int64_t flags, const int64_t* key, int64_t length,
                       uint64_t hash, OrtStatus** status) {
  *status = NULL;
  if (g_planner == NULL || !enter_python()) {
    *status = make_status(ORT_FAIL, "mha_ep MultiHeadAttention node '%s': no plan for this call signature, and "
                          "the interpreter that makes plans is shutting down", k->node);
    return NULL;
  }
  atomic_fetch_add(&g_misses, 1);
  Plan* plan = NULL;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* inputs = inputs_tuple(k, tensors, 0);
  PyObject* result = NULL;
  if (inputs == NULL) {
    *status = status_from_python_error(k->node, "planning");
    goto done;
  }
  result = PyObject_CallFunction(g_planner, "lsiLN", k->config, k->node, k->device, (long long)flags, inputs);
  if (result == NULL || !PyBytes_Check(result)) {
    *status = status_from_result(result, k->node, "planning");
    if (*status == NULL) *status = make_status(ORT_FAIL, "mha_ep MultiHeadAttention node '%s': no plan", k->node);
    goto done;
  }
  Py_ssize_t size = PyBytes_Size(result);
  if (size % 8) {
    *status = make_status(ORT_FAIL, "mha_ep MultiHeadAttention node '%s': a plan of %zd bytes", k->node, size);
    goto done;
  }
  char error[512];
  plan = parse_plan((const int64_t*)PyBytes_AsString(result), size / 8, error, sizeof error);
  if (plan == NULL) {
    *status = make_status(ORT_FAIL, "mha_ep MultiHeadAttention node '%s': %s", k->node, error);
    goto done;
  }
  plan->key = malloc((size_t)length * 8);
  if (plan->key == NULL) {
    free_plan(plan);
    plan = NULL;
    *status = make_status(ORT_FAIL, "mha_ep MultiHeadAttention node '%s': out of host memory", k->node);
    goto done;
  }
  memcpy(plan->key, key, (size_t)length * 8);
  plan->key_length = length;
  plan->hash = hash;
done:
  Py_XDECREF(result);
  PyGILState_Release(gil);
  leave_python();
  return plan == NULL ? NULL : insert_plan(plan);
}

/* The sentence of a shared-buffer kernel's report (mha_ep/launch.py device_error_text words it the same). */
enum { DEVICE_OK = 0, PAST_LENGTH_RANGE = 1, PAST_PLUS_LENGTH = 2, BEAM_INDEX = 3, MASK_LENGTH = 4, BIAS_LENGTH = 5 };

static void device_error_text(const int32_t* w, int64_t beams, char* out, size_t size) {
  switch (w[0]) {
    case PAST_LENGTH_RANGE:
      snprintf(out, size, "past_sequence_length must be non-negative and less than max_sequence_length (%d), got %d",
               w[2], w[1]);
      break;
    case PAST_PLUS_LENGTH:
      snprintf(out, size, "past_sequence_length (%d) plus kv_sequence_length (%d) must not exceed "
               "max_sequence_length (%d).", w[1], w[2], w[3]);
      break;
    case BEAM_INDEX:
      snprintf(out, size, "cache_indirection beam index out of range. Expected [0, %lld), got %d at flattened "
               "batch_beam index %d, sequence position %d", (long long)beams, w[1], w[2], w[3]);
      break;
    case MASK_LENGTH:
      snprintf(out, size, "key_padding_mask covers %d keys, but past_sequence_length + kv_sequence_length is %d", w[1],
               w[2]);
      break;
    case BIAS_LENGTH:
      snprintf(out, size, "Input 'attention_bias' dimension 3 should be same as total_sequence_length (%d), got %d",
               w[2], w[1]);
      break;
    default:
      snprintf(out, size, "device error code %d (%d, %d, %d)", w[0], w[1], w[2], w[3]);
  }
}

static OrtStatus* launch_error(const Kernel* k, const char* what, CUresult result) {
  return make_status(ORT_EP_FAIL, "mha_ep MultiHeadAttention node '%s': %s failed on CUDA device %d: %s (CUresult %d)",
                     k->node, what, k->device, cu_error_text(result), result);
}

static OrtStatus* run_plan(const Kernel* k, const Plan* plan, const Bases* bases, CUstream stream,
                           OrtKernelContext* context) {
  _Alignas(64) unsigned char arguments[MAX_ARGUMENT_BYTES];
  void* parameters[MAX_ARGUMENTS];
  void* cublas_handle = NULL;
  for (int64_t i = 0; i < plan->n_steps; ++i) {
    const Step* s = &plan->steps[i];
    CUresult result = 0;
    if (s->kind == STEP_LAUNCH) {
      memcpy(arguments, s->blob, (size_t)s->blob_bytes);
      for (int64_t p = 0; p < s->n_patches; ++p) {
        uint64_t address = resolve(bases, s->patches[p].ref);
        memcpy(arguments + s->patches[p].offset, &address, 8);
      }
      for (int64_t m = 0; m < s->n_maps; ++m) {
        const MapPatch* map = &s->maps[m];
        if (cu.cuTensorMapEncodeTiled == NULL) {
          return make_status(ORT_EP_FAIL, "mha_ep MultiHeadAttention node '%s': the CUDA driver has no "
                             "cuTensorMapEncodeTiled (TMA maps need a CUDA 12 or newer driver)", k->node);
        }
        result = cu.cuTensorMapEncodeTiled(arguments + map->offset, (int)map->dtype, (uint32_t)map->rank,
                                           (void*)(uintptr_t)resolve(bases, map->ref), map->dims, map->strides,
                                           map->box, map->element_strides, (int)map->interleave, (int)map->swizzle,
                                           (int)map->l2, (int)map->oob);
        if (result != 0) return launch_error(k, "encoding a TMA tensor map", result);
      }
      for (int64_t a = 0; a < s->n_args; ++a) parameters[a] = arguments + s->arg_offsets[a];
      result = cu.cuLaunchKernel(s->function, s->grid[0], s->grid[1], s->grid[2], s->block[0], s->block[1],
                                 s->block[2], s->shared, stream, parameters, NULL);
      if (result != 0) return launch_error(k, "a kernel launch", result);
    } else if (s->kind == STEP_GEMM) {
      if (!load_cublas()) return make_status(ORT_EP_FAIL, "mha_ep MultiHeadAttention node '%s': %s", k->node, cublas.error);
      if (cublas_handle == NULL) {
        OrtStatus* status = API(GetResourceFn, API_KernelContext_GetResource)(
            context, CUDA_RESOURCE_VERSION, CUDA_RESOURCE_CUBLAS_HANDLE, &cublas_handle);
        if (status != NULL) {
          char text[512];
          status_text(status, text, sizeof text);
          return make_status(ORT_EP_FAIL, "mha_ep MultiHeadAttention node '%s': ORT's cuBLAS handle: %s", k->node, text);
        }
      }
      const float beta = 0.0f;
      int done = cublas.gemm(cublas_handle, (int)s->trans_a, (int)s->trans_b, (int)s->m, (int)s->n, (int)s->k,
                             &s->alpha, (const void*)(uintptr_t)resolve(bases, s->a), (int)s->a_type, (int)s->lda,
                             s->stride_a, (const void*)(uintptr_t)resolve(bases, s->b), (int)s->b_type, (int)s->ldb,
                             s->stride_b, &beta, (void*)(uintptr_t)resolve(bases, s->c), 0 /* CUDA_R_32F */,
                             (int)s->ldc, s->stride_c, (int)s->batch, (int)s->compute, -1 /* CUBLAS_GEMM_DEFAULT */);
      if (done != 0) {
        return make_status(ORT_EP_FAIL, "mha_ep MultiHeadAttention node '%s': cublasGemmStridedBatchedEx failed "
                           "(cublasStatus %d)", k->node, done);
      }
    } else if (s->kind == STEP_COPY) {
      uint64_t dst = resolve(bases, s->dst), src = resolve(bases, s->src); /* equal: a present bound to its past */
      if (s->nbytes && dst != src) result = cu.cuMemcpyAsync(dst, src, (size_t)s->nbytes, stream);
      if (result != 0) return launch_error(k, "a device copy", result);
    } else if (s->kind == STEP_FILL) {
      if (s->nbytes) result = cu.cuMemsetD8Async(resolve(bases, s->dst), (unsigned char)s->byte, (size_t)s->nbytes, stream);
      if (result != 0) return launch_error(k, "a device fill", result);
    } else if (s->kind == STEP_CHECK_STATUS) {
      /* After an eager call, the kernels' report becomes ORT's error; under a CUDA graph's capture the host cannot
       * wait for it (the decode loop reads the sticky words instead: error_words). */
      int capturing = 0;
      if (cu.cuStreamIsCapturing == NULL || cu.cuStreamSynchronize == NULL || cu.cuMemcpyDtoHAsync == NULL) continue;
      result = cu.cuStreamIsCapturing(stream, &capturing);
      if (result != 0) return launch_error(k, "asking whether the stream is capturing", result);
      if (capturing) continue;
      int32_t words[STATUS_WORDS];
      result = cu.cuMemcpyDtoHAsync(words, resolve(bases, s->dst), sizeof words, stream);
      if (result == 0) result = cu.cuStreamSynchronize(stream);
      if (result != 0) return launch_error(k, "reading the shared buffer's status", result);
      if (words[0] != DEVICE_OK) {
        char text[512];
        device_error_text(words, s->beams, text, sizeof text);
        return make_status(ORT_INVALID_ARGUMENT, "mha_ep MultiHeadAttention node '%s': %s", k->node, text);
      }
    }
  }
  return NULL;
}

static OrtStatus* compute_cuda(Kernel* k, OrtKernelContext* context) {
  Tensor tensors[MAX_INPUTS];
  Bases bases;
  memset(tensors, 0, sizeof tensors);
  memset(&bases, 0, sizeof bases);
  int64_t key[MAX_KEY];
  int64_t length = 0;
  key[length++] = k->config;
  key[length++] = k->device;
  int64_t flags_at = length++;
  key[flags_at] = 0;
  for (int slot = 0; slot < MAX_INPUTS; ++slot) {
    if (!(k->supplied & (1u << slot))) continue;
    OrtStatus* status = read_input(context, (size_t)slot, &tensors[slot], k->node);
    if (status != NULL) return status;
    const Tensor* t = &tensors[slot];
    bases.input[slot] = t->data;
    key[length++] = slot;
    key[length++] = t->type;
    key[length++] = (int64_t)t->rank;
    for (size_t d = 0; d < t->rank; ++d) key[length++] = t->dims[d];
    key[length++] = alignment_log2(t->data);
  }
  void* stream = NULL;
  OrtStatus* status = API(GetStreamFn, API_KernelContext_GetGPUComputeStream)(context, &stream);
  if (status != NULL) return status;

  Plan* plan = NULL;
  for (int64_t flags = 0; flags < 2; ++flags) { /* flags 1: outputs not aligned for vector stores */
    key[flags_at] = flags;
    uint64_t hash = hash_key(key, length);
    plan = lookup_plan(key, length, hash);
    if (plan != NULL) {
      atomic_fetch_add(&g_hits, 1);
    } else {
      plan = make_plan(k, tensors, flags, key, length, hash, &status);
      if (plan == NULL) return status;
    }
    for (int o = 0; o < MAX_OUTPUTS; ++o) {
      OrtValue* value = NULL;
      status = API(GetOutputFn, API_KernelContext_GetOutput)(context, (size_t)o, plan->output_dims[o],
                                                             (size_t)plan->output_rank[o], &value);
      if (status == NULL) status = API(GetTensorMutableDataFn, API_GetTensorMutableData)(value, &bases.output[o]);
      if (status != NULL) {
        release_plan(plan);
        return status;
      }
    }
    int aligned = 1;
    for (int o = 0; o < MAX_OUTPUTS; ++o) {
      if ((uintptr_t)bases.output[o] % (uintptr_t)plan->output_alignment) aligned = 0;
    }
    if (aligned || flags == 1) break;
    release_plan(plan);
    plan = NULL;
  }

  CUcontext previous = NULL;
  CUresult result = cu.cuCtxGetCurrent(&previous);
  int switched = result == 0 && previous != k->context;
  if (result != 0 || (switched && (result = cu.cuCtxSetCurrent(k->context)) != 0)) {
    release_plan(plan);
    return launch_error(k, "making the device's context current", result);
  }
  int capturing = 0;
  if (cu.cuStreamIsCapturing != NULL && cu.cuStreamIsCapturing(stream, &capturing) == 0 && capturing &&
      k->device >= 0 && k->device < MAX_DEVICES) {
    bases.sticky = (void*)(uintptr_t)g_error_device[k->device]; /* allocated by the planner, before any capture */
  }
  if (plan->scratch_bytes > 0) {
    status = API(GetScratchBufferFn, API_KernelContext_GetScratchBuffer)(context, k->memory,
                                                                         (size_t)plan->scratch_bytes, &bases.scratch);
    if (status == NULL && bases.scratch == NULL) {
      status = make_status(ORT_EP_FAIL, "mha_ep MultiHeadAttention node '%s': no scratch buffer of %lld bytes",
                           k->node, (long long)plan->scratch_bytes);
    }
  }
  if (status == NULL) status = run_plan(k, plan, &bases, stream, context);
  /* ORT's arena orders reuse of the scratch by the stream it was taken on, as for its own kernels' scratch. */
  if (bases.scratch != NULL) k->allocator->Free(k->allocator, bases.scratch);
  if (switched) cu.cuCtxSetCurrent(previous);
  release_plan(plan);
  return status;
}

static OrtStatus* kernel_compute(void* opaque, OrtKernelContext* context) {
  Kernel* k = opaque;
  return k->ep == EP_CUDA ? compute_cuda(k, context) : compute_cpu(k, context);
}

/* --------------------------------------------------------------------------------- ops and registration */
static const int FLOAT_TYPES[] = {ELEM_FLOAT, ELEM_FLOAT16, ELEM_BFLOAT16};
static const int MASK_TYPES[] = {ELEM_INT32, ELEM_INT64};
#define VARIANTS_PER_EP 6
static OpVariant g_ops[2][VARIANTS_PER_EP];
static OrtCustomOpDomain* g_domains[2]; /* [0]: CPU kernels only; [1]: CPU and CUDA kernels. Never released: a
                                           domain must outlive every session made from options holding it. */
static pthread_mutex_t g_domain_lock = PTHREAD_MUTEX_INITIALIZER;

static void init_ops(void) {
  for (int ep = 0; ep < 2; ++ep) {
    for (int f = 0; f < 3; ++f) {
      for (int m = 0; m < 2; ++m) {
        OpVariant* v = &g_ops[ep][f * 2 + m];
        memset(v, 0, sizeof *v);
        v->ep = ep;
        v->float_type = FLOAT_TYPES[f];
        v->mask_type = MASK_TYPES[m];
        v->op.version = OP_VERSION;
        v->op.GetName = op_name;
        v->op.GetExecutionProviderType = op_provider;
        v->op.GetInputType = op_input_type;
        v->op.GetInputTypeCount = op_input_count;
        v->op.GetOutputType = op_output_type;
        v->op.GetOutputTypeCount = op_output_count;
        v->op.KernelDestroy = kernel_destroy;
        v->op.GetInputCharacteristic = op_characteristic;
        v->op.GetOutputCharacteristic = op_characteristic;
        v->op.GetInputMemoryType = op_memory_type;
        v->op.GetVariadicInputMinArity = op_min_arity;
        v->op.GetVariadicInputHomogeneity = op_homogeneity;
        v->op.GetVariadicOutputMinArity = op_min_arity;
        v->op.GetVariadicOutputHomogeneity = op_homogeneity;
        v->op.CreateKernelV2 = kernel_create;
        v->op.KernelComputeV2 = kernel_compute;
        v->op.GetStartVersion = op_start_version;
      }
    }
  }
}

#define CONFIG_EPS "mha_ep.native_eps" /* session config entry: "cpu" or "cpu,cuda" (mha_ep/native/registration) */

/* ORT's entry point: add the mha_ep domain to ``options``. */
__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                    const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_USED);
  if (api == NULL) return NULL; /* an ORT older than 1.18: nothing can be reported through it */
  pthread_mutex_lock(&g_domain_lock);
  if (g_api == NULL) {
    g_api = api;
    init_ops();
  }
  pthread_mutex_unlock(&g_domain_lock);
  char eps[64] = "cpu";
  size_t size = sizeof eps;
  OrtStatus* status = API(GetSessionConfigEntryFn, API_GetSessionConfigEntry)(options, CONFIG_EPS, eps, &size);
  if (status != NULL) {
    release_status(status);
    snprintf(eps, sizeof eps, "cpu");
  }
  int with_cuda = strstr(eps, "cuda") != NULL;
  pthread_mutex_lock(&g_domain_lock);
  if (g_domains[with_cuda] == NULL) {
    OrtCustomOpDomain* domain = NULL;
    status = API(CreateCustomOpDomainFn, API_CreateCustomOpDomain)("mha_ep", &domain);
    for (int ep = 0; status == NULL && ep <= with_cuda; ++ep) {
      for (int i = 0; status == NULL && i < VARIANTS_PER_EP; ++i) {
        status = API(CustomOpDomain_AddFn, API_CustomOpDomain_Add)(domain, &g_ops[ep][i].op);
      }
    }
    if (status == NULL) g_domains[with_cuda] = domain; /* a failed domain is leaked, never half used */
  }
  OrtCustomOpDomain* domain = g_domains[with_cuda];
  pthread_mutex_unlock(&g_domain_lock);
  if (status != NULL) return status;
  return API(AddCustomOpDomainFn, API_AddCustomOpDomain)(options, domain);
}

/* --------------------------------------------------------------------------------------- the Python module */
static PyObject* py_configure(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *describe, *planner, *cpu_compute, *attributes;
  if (!PyArg_ParseTuple(args, "OOOO!", &describe, &planner, &cpu_compute, &PyTuple_Type, &attributes)) return NULL;
  PyObject* previous[] = {g_describe, g_planner, g_cpu_compute, g_attributes};
  g_describe = Py_NewRef(describe);
  g_planner = Py_NewRef(planner);
  g_cpu_compute = Py_NewRef(cpu_compute);
  g_attributes = Py_NewRef(attributes);
  for (size_t i = 0; i < sizeof previous / sizeof previous[0]; ++i) Py_XDECREF(previous[i]);
  Py_RETURN_NONE;
}

/* kernel_output(token, index, dims) -> address of ORT's output buffer: only inside the CPU compute callback. */
static PyObject* py_kernel_output(PyObject* self, PyObject* args) {
  (void)self;
  unsigned long long token;
  Py_ssize_t index;
  PyObject* dims;
  if (!PyArg_ParseTuple(args, "KnO!", &token, &index, &PyTuple_Type, &dims)) return NULL;
  OrtKernelContext* context = (OrtKernelContext*)(uintptr_t)token;
  if (context == NULL || context != t_active_context) {
    PyErr_SetString(PyExc_RuntimeError, "kernel_output: the kernel context is not this thread's running one");
    return NULL;
  }
  if (index < 0 || index >= MAX_OUTPUTS) {
    PyErr_Format(PyExc_IndexError, "kernel_output: output index %zd is not in 0..%d", index, MAX_OUTPUTS - 1);
    return NULL;
  }
  Py_ssize_t rank = PyTuple_Size(dims);
  if (rank > MAX_RANK) {
    PyErr_Format(PyExc_ValueError, "kernel_output: rank %zd is above %d", rank, MAX_RANK);
    return NULL;
  }
  int64_t shape[MAX_RANK];
  for (Py_ssize_t d = 0; d < rank; ++d) {
    shape[d] = PyLong_AsLongLong(PyTuple_GetItem(dims, d));
    if (shape[d] == -1 && PyErr_Occurred()) return NULL;
    if (shape[d] < 0) {
      PyErr_Format(PyExc_ValueError, "kernel_output: dimension %lld is negative", (long long)shape[d]);
      return NULL;
    }
  }
  OrtValue* value = NULL;
  void* data = NULL;
  OrtStatus* status = API(GetOutputFn, API_KernelContext_GetOutput)(context, (size_t)index, shape, (size_t)rank, &value);
  if (status == NULL) status = API(GetTensorMutableDataFn, API_GetTensorMutableData)(value, &data);
  if (status != NULL) {
    char text[1024];
    status_text(status, text, sizeof text);
    PyErr_Format(PyExc_RuntimeError, "ORT could not make output %zd: %s", index, text);
    return NULL;
  }
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)data);
}

/* check_plan(bytes) -> dict: parse an encoded plan as a call would (CPU tests of the encoder and the parser). */
static PyObject* py_check_plan(PyObject* self, PyObject* args) {
  (void)self;
  const char* data;
  Py_ssize_t length;
  if (!PyArg_ParseTuple(args, "y#", &data, &length)) return NULL;
  if (length % 8) {
    PyErr_SetString(PyExc_ValueError, "a plan is a whole number of 8-byte words");
    return NULL;
  }
  int64_t* words = malloc((size_t)length + 8); /* an aligned copy of the bytes */
  if (words == NULL) return PyErr_NoMemory();
  memcpy(words, data, (size_t)length);
  char error[512];
  Plan* plan = parse_plan(words, length / 8, error, sizeof error);
  free(words);
  if (plan == NULL) {
    PyErr_SetString(PyExc_ValueError, error);
    return NULL;
  }
  PyObject* outputs = PyList_New(0);
  PyObject* steps = PyList_New(0);
  for (int o = 0; outputs && o < MAX_OUTPUTS; ++o) {
    PyObject* dims = PyTuple_New((Py_ssize_t)plan->output_rank[o]);
    for (int64_t d = 0; dims && d < plan->output_rank[o]; ++d) {
      PyTuple_SetItem(dims, (Py_ssize_t)d, PyLong_FromLongLong(plan->output_dims[o][d]));
    }
    if (dims) PyList_Append(outputs, dims);
    Py_XDECREF(dims);
  }
  static const char* KINDS[] = {"", "launch", "gemm", "copy", "fill", "check_status"};
  for (int64_t i = 0; steps && i < plan->n_steps; ++i) {
    const Step* s = &plan->steps[i];
    PyObject* entry = s->kind == STEP_LAUNCH
                          ? Py_BuildValue("{s:s,s:K,s:(III),s:(III),s:I,s:L,s:L,s:L}", "kind", KINDS[s->kind],
                                          "function", (unsigned long long)(uintptr_t)s->function, "grid", s->grid[0],
                                          s->grid[1], s->grid[2], "block", s->block[0], s->block[1], s->block[2],
                                          "shared", s->shared, "arguments", (long long)s->n_args, "patches",
                                          (long long)s->n_patches, "maps", (long long)s->n_maps)
                          : Py_BuildValue("{s:s}", "kind", KINDS[s->kind]);
    if (entry) PyList_Append(steps, entry);
    Py_XDECREF(entry);
  }
  PyObject* summary = Py_BuildValue("{s:L,s:L,s:N,s:N}", "scratch_bytes", (long long)plan->scratch_bytes,
                                    "output_alignment", (long long)plan->output_alignment, "outputs", outputs,
                                    "steps", steps);
  free_plan(plan);
  return summary;
}


/* Run ``body`` with device ``device``'s primary context current (the caller's restored after); the result. */
static CUresult on_device(int device, CUresult (*body)(int, void*), void* data) {
  CUdevice handle;
  CUcontext context = NULL, previous = NULL;
  CUresult result = cu.cuDeviceGet(&handle, device);
  if (result == 0) result = cu.cuDevicePrimaryCtxRetain(&context, handle);
  if (result != 0) return result;
  result = cu.cuCtxGetCurrent(&previous);
  if (result == 0) result = cu.cuCtxSetCurrent(context);
  if (result == 0) {
    result = body(device, data);
    cu.cuCtxSetCurrent(previous);
  }
  cu.cuDevicePrimaryCtxRelease(handle);
  return result;
}

static CUresult allocate_error_words(int device, void* data) {
  (void)data;
  CUdeviceptr address = 0;
  CUresult result = cu.cuMemAlloc(&address, STATUS_WORDS * sizeof(int32_t));
  if (result == 0) result = cu.cuMemsetD8(address, 0, STATUS_WORDS * sizeof(int32_t));
  if (result == 0) g_error_device[device] = address;
  return result;
}

static CUresult read_error_words(int device, void* data) {
  int32_t* words = data;
  CUresult result = cu.cuMemcpyDtoH(words, g_error_device[device], STATUS_WORDS * sizeof(int32_t));
  if (result == 0 && words[0] != DEVICE_OK) result = cu.cuMemsetD8(g_error_device[device], 0, STATUS_WORDS * sizeof(int32_t));
  return result;
}

/* error_words(device) -> the device address of the device's sticky words, allocated on the first call. */
static PyObject* py_error_words(PyObject* self, PyObject* args) {
  (void)self;
  int device;
  if (!PyArg_ParseTuple(args, "i", &device)) return NULL;
  if (device < 0 || device >= MAX_DEVICES) {
    PyErr_Format(PyExc_ValueError, "error_words: device %d is not in 0..%d", device, MAX_DEVICES - 1);
    return NULL;
  }
  if (!load_cuda() || cu.cuMemAlloc == NULL || cu.cuMemcpyDtoH == NULL || cu.cuMemsetD8 == NULL) {
    PyErr_Format(PyExc_RuntimeError, "error_words: %s", cu.error[0] ? cu.error : "the CUDA driver lacks cuMemAlloc");
    return NULL;
  }
  CUresult result = 0;
  pthread_mutex_lock(&g_library_lock);
  if (g_error_device[device] == 0) result = on_device(device, allocate_error_words, NULL);
  CUdeviceptr address = g_error_device[device];
  pthread_mutex_unlock(&g_library_lock);
  if (result != 0) {
    PyErr_Format(PyExc_RuntimeError, "error_words: device memory on device %d: %s (CUresult %d)", device,
                 cu_error_text(result), result);
    return NULL;
  }
  return PyLong_FromUnsignedLongLong((unsigned long long)address);
}

/* take_device_error(device) -> None, or (code, a, b, c, site, beams) of the first report since the last take
 * (cleared). Synchronous: call it once the stream that replays the graphs has been synchronized. */
static PyObject* py_take_device_error(PyObject* self, PyObject* args) {
  (void)self;
  int device;
  if (!PyArg_ParseTuple(args, "i", &device)) return NULL;
  if (device < 0 || device >= MAX_DEVICES || g_error_device[device] == 0) Py_RETURN_NONE;
  int32_t words[STATUS_WORDS] = {0};
  CUresult result;
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&g_library_lock);
  result = on_device(device, read_error_words, words);
  pthread_mutex_unlock(&g_library_lock);
  Py_END_ALLOW_THREADS
  if (result != 0) {
    PyErr_Format(PyExc_RuntimeError, "take_device_error: reading device %d: %s (CUresult %d)", device,
                 cu_error_text(result), result);
    return NULL;
  }
  if (words[0] == DEVICE_OK) Py_RETURN_NONE;
  return Py_BuildValue("(iiiiii)", words[0], words[1], words[2], words[3], words[4], words[5]);
}

/* ------------------------------------------------------------------------- a graph replay's copies, from Python
 * launch_copies (mha_ep/native/segments.py, cuda_io rule 7): one call queues what a graph session's replay does
 * around ORT's run on ORT's stream, with the driver and no Python in between: ORT's stream waits for the caller's
 * (an event), the copy kernel copies a table's segments, and the caller's stream waits for ORT's (another event).
 * CuPy's launch of the same kernel and its event calls cost several times the driver's own (docs/BENCH.md). */
#define COPY_SEGMENTS 16 /* kernels/copy_segments.cu's MAX_SEGMENTS: one table's copies */

static CUcontext g_primary[MAX_DEVICES]; /* each device's primary context, retained once for the process */
static PyObject* g_data_name = NULL;     /* "data": a CuPy array's MemoryPointer */
static PyObject* g_ptr_name = NULL;      /* "ptr": its device address */

/* The device address of ``item``: an int, or an object with .data.ptr (a CuPy array). -1 with an exception set. */
static int item_address(PyObject* item, uint64_t* out) {
  if (PyLong_Check(item)) {
    *out = (uint64_t)PyLong_AsUnsignedLongLong(item);
    return PyErr_Occurred() ? -1 : 0;
  }
  if (g_data_name == NULL && (g_data_name = PyUnicode_InternFromString("data")) == NULL) return -1;
  if (g_ptr_name == NULL && (g_ptr_name = PyUnicode_InternFromString("ptr")) == NULL) return -1;
  PyObject* data = PyObject_GetAttr(item, g_data_name);
  if (data == NULL) return -1;
  PyObject* pointer = PyObject_GetAttr(data, g_ptr_name);
  Py_DECREF(data);
  if (pointer == NULL) return -1;
  *out = (uint64_t)PyLong_AsUnsignedLongLong(pointer);
  Py_DECREF(pointer);
  return PyErr_Occurred() ? -1 : 0;
}

static int fast_u64(PyObject* const* args, Py_ssize_t i, uint64_t* out) {
  *out = (uint64_t)PyLong_AsUnsignedLongLong(args[i]);
  return PyErr_Occurred() ? -1 : 0;
}

static PyObject* copies_failed(const char* what, int device, CUresult result) {
  PyErr_Format(PyExc_RuntimeError, "mha_ep: a graph replay's %s failed on CUDA device %d: %s (CUresult %d)", what,
               device, cu_error_text(result), result);
  return NULL;
}

/* launch_copies(device, function, grid_x, grid_y, block_x, table, column, stream, addresses, wait_event,
 *               wait_stream, signal_event, signal_stream) -> None (what a call changes last: the stream onwards)
 * On ``device`` (its primary context, made current for the call): where ``wait_event`` is not 0, record it on
 * ``wait_stream`` and make ``stream`` wait for it; write the addresses (ints, or CuPy arrays: their .data.ptr) into
 * the table's ``column`` (a host address: its src or dst array), launch ``function`` (the copy kernel, a CUfunction)
 * with the table at ``table`` as its one parameter, by value, on ``stream``; where ``signal_event`` is not 0, record
 * it on ``stream`` and make ``signal_stream`` wait for it. Nothing is launched when an address cannot be read. */
static PyObject* py_launch_copies(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 13) {
    PyErr_Format(PyExc_TypeError, "launch_copies takes 13 arguments (%zd given)", nargs);
    return NULL;
  }
  uint64_t device, function, stream, grid_x, grid_y, block_x, table, column, wait_event, wait_stream, signal_event,
      signal_stream;
  if (fast_u64(args, 0, &device) || fast_u64(args, 1, &function) || fast_u64(args, 2, &grid_x) ||
      fast_u64(args, 3, &grid_y) || fast_u64(args, 4, &block_x) || fast_u64(args, 5, &table) ||
      fast_u64(args, 6, &column) || fast_u64(args, 7, &stream) || fast_u64(args, 9, &wait_event) ||
      fast_u64(args, 10, &wait_stream) || fast_u64(args, 11, &signal_event) || fast_u64(args, 12, &signal_stream)) {
    return NULL;
  }
  if (device >= MAX_DEVICES || function == 0 || table == 0 || column < table || column >= table + 3 * 8 * COPY_SEGMENTS
      || grid_x == 0 || grid_y == 0 || grid_y > COPY_SEGMENTS || block_x == 0) {
    PyErr_Format(PyExc_ValueError, "launch_copies: device %llu, function %llu, grid (%llu, %llu), block %llu, table "
                 "%llu, column %llu: not a copy launch (device < %d, at most %d segments)", (unsigned long long)device,
                 (unsigned long long)function, (unsigned long long)grid_x, (unsigned long long)grid_y,
                 (unsigned long long)block_x, (unsigned long long)table, (unsigned long long)column, MAX_DEVICES,
                 COPY_SEGMENTS);
    return NULL;
  }
  Py_ssize_t count = PySequence_Size(args[8]);
  if (count < 0) return NULL;
  if ((uint64_t)count > grid_y) {
    PyErr_Format(PyExc_ValueError, "launch_copies: %zd addresses for a launch of %llu segments", count,
                 (unsigned long long)grid_y);
    return NULL;
  }
  if (column + (uint64_t)count * 8 > table + 3 * 8 * COPY_SEGMENTS) {
    PyErr_Format(PyExc_ValueError, "launch_copies: %zd addresses from column %llu run past the table's end", count,
                 (unsigned long long)column);
    return NULL;
  }
  uint64_t addresses[COPY_SEGMENTS];
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PySequence_GetItem(args[8], i);
    if (item == NULL) return NULL;
    int failed = item_address(item, &addresses[i]);
    Py_DECREF(item);
    if (failed) return NULL;
  }
  if (!load_cuda()) {
    PyErr_Format(PyExc_RuntimeError, "launch_copies: %s", cu.error);
    return NULL;
  }
  if ((wait_event || signal_event) && (cu.cuEventRecord == NULL || cu.cuStreamWaitEvent == NULL)) {
    PyErr_SetString(PyExc_RuntimeError, "launch_copies: the CUDA driver lacks cuEventRecord or cuStreamWaitEvent");
    return NULL;
  }
  CUresult result = 0;
  CUcontext context = g_primary[device], previous = NULL;
  if (context == NULL) {
    CUdevice handle;
    pthread_mutex_lock(&g_library_lock);
    if (g_primary[device] == NULL) {
      result = cu.cuDeviceGet(&handle, (int)device);
      if (result == 0) result = cu.cuDevicePrimaryCtxRetain(&g_primary[device], handle);
    }
    context = g_primary[device];
    pthread_mutex_unlock(&g_library_lock);
    if (result != 0) return copies_failed("device context", (int)device, result);
  }
  result = cu.cuCtxGetCurrent(&previous);
  int switched = result == 0 && previous != context;
  if (result != 0 || (switched && (result = cu.cuCtxSetCurrent(context)) != 0)) {
    return copies_failed("device context", (int)device, result);
  }
  const char* what = "wait for the caller's stream";
  if (wait_event) {
    result = cu.cuEventRecord((void*)(uintptr_t)wait_event, (CUstream)(uintptr_t)wait_stream);
    if (result == 0) result = cu.cuStreamWaitEvent((CUstream)(uintptr_t)stream, (void*)(uintptr_t)wait_event, 0);
  }
  if (result == 0) {
    what = "copy kernel launch";
    memcpy((void*)(uintptr_t)column, addresses, (size_t)count * sizeof addresses[0]);
    void* parameters[1] = {(void*)(uintptr_t)table};
    result = cu.cuLaunchKernel((CUfunction)(uintptr_t)function, (unsigned)grid_x, (unsigned)grid_y, 1,
                               (unsigned)block_x, 1, 1, 0, (CUstream)(uintptr_t)stream, parameters, NULL);
  }
  if (result == 0 && signal_event) {
    what = "signal to the caller's stream";
    result = cu.cuEventRecord((void*)(uintptr_t)signal_event, (CUstream)(uintptr_t)stream);
    if (result == 0) {
      result = cu.cuStreamWaitEvent((CUstream)(uintptr_t)signal_stream, (void*)(uintptr_t)signal_event, 0);
    }
  }
  if (switched) cu.cuCtxSetCurrent(previous);
  if (result != 0) return copies_failed(what, (int)device, result);
  Py_RETURN_NONE;
}

/* driver_error() -> None where the CUDA driver loads (launch_copies can run), else why not. */
static PyObject* py_driver_error(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  if (load_cuda()) Py_RETURN_NONE;
  return PyUnicode_FromString(cu.error);
}

/* device_error_text(code, a, b, c, beams) -> the C side's sentence (tests compare it with launch.py's). */
static PyObject* py_device_error_text(PyObject* self, PyObject* args) {
  (void)self;
  int32_t words[STATUS_WORDS] = {0};
  long long beams;
  if (!PyArg_ParseTuple(args, "iiiiL", &words[0], &words[1], &words[2], &words[3], &beams)) return NULL;
  char text[512];
  device_error_text(words, beams, text, sizeof text);
  return PyUnicode_FromString(text);
}

static PyObject* py_stats(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  pthread_mutex_lock(&g_plan_lock);
  long long plans = (long long)g_plan_count;
  pthread_mutex_unlock(&g_plan_lock);
  return Py_BuildValue("{s:L,s:L,s:L,s:L}", "plans", plans, "hits", (long long)atomic_load(&g_hits), "misses",
                       (long long)atomic_load(&g_misses), "evictions", (long long)atomic_load(&g_evictions));
}

static PyObject* py_clear_plans(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  pthread_mutex_lock(&g_plan_lock);
  clear_plans_locked();
  pthread_mutex_unlock(&g_plan_lock);
  Py_RETURN_NONE;
}

static PyObject* py_shutdown(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  atomic_store(&g_finalizing, 1);
  Py_BEGIN_ALLOW_THREADS /* the calls inside Python finish (at most 10 s) before the interpreter goes */
  for (int waited = 0; waited < 10000 && atomic_load(&g_inside_python) > 0; ++waited) {
    struct timespec millisecond = {0, 1000000};
    nanosleep(&millisecond, NULL);
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject* py_layout(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  return Py_BuildValue(
      "{s:i,s:i,s:n,s:n,s:n,s:n,s:n,s:n,s:n}", "api_version", ORT_API_USED, "op_version", OP_VERSION,
      "custom_op_size", (Py_ssize_t)sizeof(OrtCustomOp), "create_kernel_v2", (Py_ssize_t)offsetof(OrtCustomOp, CreateKernelV2),
      "kernel_compute_v2", (Py_ssize_t)offsetof(OrtCustomOp, KernelComputeV2), "get_start_version",
      (Py_ssize_t)offsetof(OrtCustomOp, GetStartVersion), "input_memory_type",
      (Py_ssize_t)offsetof(OrtCustomOp, GetInputMemoryType), "plan_magic", (Py_ssize_t)PLAN_MAGIC, "plan_version",
      (Py_ssize_t)PLAN_VERSION);
}

static PyObject* py_ordinals(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  return Py_BuildValue(
      "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}",
      "CreateStatus", API_CreateStatus, "GetErrorMessage", API_GetErrorMessage, "CreateCustomOpDomain",
      API_CreateCustomOpDomain, "CustomOpDomain_Add", API_CustomOpDomain_Add, "AddCustomOpDomain",
      API_AddCustomOpDomain, "GetTensorMutableData", API_GetTensorMutableData, "GetTensorElementType",
      API_GetTensorElementType, "GetDimensionsCount", API_GetDimensionsCount, "GetDimensions", API_GetDimensions,
      "GetTensorTypeAndShape", API_GetTensorTypeAndShape, "MemoryInfoGetId", API_MemoryInfoGetId,
      "KernelInfoGetAttribute_float", API_KernelInfoGetAttribute_float, "KernelInfoGetAttribute_int64",
      API_KernelInfoGetAttribute_int64, "KernelInfoGetAttribute_string", API_KernelInfoGetAttribute_string,
      "KernelContext_GetInputCount", API_KernelContext_GetInputCount, "KernelContext_GetOutputCount",
      API_KernelContext_GetOutputCount, "KernelContext_GetInput", API_KernelContext_GetInput,
      "KernelContext_GetOutput", API_KernelContext_GetOutput, "ReleaseStatus", API_ReleaseStatus,
      "ReleaseTensorTypeAndShapeInfo", API_ReleaseTensorTypeAndShapeInfo, "ReleaseAllocator", API_ReleaseAllocator,
      "KernelContext_GetGPUComputeStream", API_KernelContext_GetGPUComputeStream, "GetSessionConfigEntry",
      API_GetSessionConfigEntry, "KernelInfo_GetNodeName", API_KernelInfo_GetNodeName, "KernelContext_GetResource",
      API_KernelContext_GetResource, "KernelContext_GetScratchBuffer", API_KernelContext_GetScratchBuffer,
      "KernelInfoGetAllocator", API_KernelInfoGetAllocator);
}

/* MHA_EP_SOURCE_SHA256: the SHA-256 of this file as setup.py built it (mha_ep/native/__init__.py refuses a library
 * built from another _native.c than the one beside it); "" when built without setup.py. */
#ifndef MHA_EP_SOURCE_SHA256
#define MHA_EP_SOURCE_SHA256 ""
#endif
static PyObject* py_source_sha256(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  return PyUnicode_FromString(MHA_EP_SOURCE_SHA256);
}

static PyMethodDef METHODS[] = {
    {"configure", py_configure, METH_VARARGS, "configure(describe, planner, cpu_compute, attributes)"},
    {"kernel_output", py_kernel_output, METH_VARARGS, "kernel_output(token, index, dims) -> address"},
    {"check_plan", py_check_plan, METH_VARARGS, "check_plan(bytes) -> dict: parse an encoded plan"},
    {"stats", py_stats, METH_NOARGS, "stats() -> dict: plans cached, hits, misses, evictions"},
    {"error_words", py_error_words, METH_VARARGS, "error_words(device) -> device address of the sticky report words"},
    {"take_device_error", py_take_device_error, METH_VARARGS,
     "take_device_error(device) -> None | (code, a, b, c, site, beams): the first report since the last take"},
    {"device_error_text", py_device_error_text, METH_VARARGS, "device_error_text(code, a, b, c, beams) -> str"},
    {"clear_plans", py_clear_plans, METH_NOARGS, "clear_plans(): forget every plan"},
    {"shutdown", py_shutdown, METH_NOARGS, "shutdown(): no Python callback from now on (atexit)"},
    {"layout", py_layout, METH_NOARGS, "layout() -> dict: the ABI layout this library was built with"},
    {"ordinals", py_ordinals, METH_NOARGS, "ordinals() -> dict: the OrtApi ordinals this library calls"},
    {"source_sha256", py_source_sha256, METH_NOARGS, "source_sha256() -> the SHA-256 of the _native.c it was built from"},
    {"launch_copies", (PyCFunction)(void (*)(void))py_launch_copies, METH_FASTCALL,
     "launch_copies(device, function, grid_x, grid_y, block_x, table, column, stream, addresses, wait_event, "
     "wait_stream, signal_event, signal_stream): a graph replay's copies and events on ORT's stream"},
    {"driver_error", py_driver_error, METH_NOARGS, "driver_error() -> None where the CUDA driver loads, else why not"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_native", "mha_ep's native custom-op library", -1, METHODS,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&MODULE); }
