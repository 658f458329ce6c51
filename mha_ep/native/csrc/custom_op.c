/* custom_op.c: the custom ops as ORT sees them: the OrtCustomOp variants (MultiHeadAttention for CPU and CUDA, by
 * float and mask element type; DecodeMatMul by float type), a kernel's create (its node described by the Python
 * side; CUDA: the device, its allocator and primary context), compute (cpu_compute.c, cuda_compute.c) and destroy,
 * and RegisterCustomOps, the library's entry point for ORT, which adds the domain ``mha_ep``. */
#include "native.h"

/* ------------------------------------------------------------------------------------------- the kernels */
typedef struct {
  OrtCustomOp op;
  int kind, ep, float_type, mask_type; /* kind: OP_MHA | OP_MATMUL (mask_type: MultiHeadAttention's only) */
} OpVariant;

static const char* const OP_NAMES[] = {"MultiHeadAttention", "DecodeMatMul"};

static const char* op_name(const OrtCustomOp* op) {
  return OP_NAMES[((const OpVariant*)op)->kind];
}

static const char* op_provider(const OrtCustomOp* op) {
  return ((const OpVariant*)op)->ep == EP_CUDA ? "CUDAExecutionProvider" : NULL;
}

static int op_input_type(const OrtCustomOp* op, size_t index) {
  const OpVariant* v = (const OpVariant*)op;
  if (v->kind == OP_MATMUL) return v->float_type;
  if (index == 4) return v->mask_type;
  return index == 8 || index == 9 ? ELEM_INT32 : v->float_type; /* past_sequence_length, cache_indirection */
}

static size_t op_input_count(const OrtCustomOp* op) {
  return ((const OpVariant*)op)->kind == OP_MATMUL ? MATMUL_INPUTS : MAX_INPUTS;
}

static int op_output_type(const OrtCustomOp* op, size_t index) {
  (void)index;
  return ((const OpVariant*)op)->float_type;
}

static size_t op_output_count(const OrtCustomOp* op) {
  return ((const OpVariant*)op)->kind == OP_MATMUL ? MATMUL_OUTPUTS : MAX_OUTPUTS;
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
    return make_status(ORT_FAIL, "mha_ep %s: the mha_ep Python package is not ready (it was not imported, or the "
                                 "interpreter is shutting down)", k->op_name);
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
  result = PyObject_CallFunction(g_describe, "Oss", attributes, k->ep == EP_CUDA ? "cuda" : "cpu", k->op_name);
  if (result == NULL) goto python_error;
  if (PyTuple_Check(result) && PyTuple_Size(result) == 3 && PyLong_Check(PyTuple_GetItem(result, 0))) {
    k->config = PyLong_AsLong(PyTuple_GetItem(result, 0));
    k->supplied = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GetItem(result, 1));
    const char* node = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(result, 2), NULL);
    if (node == NULL || PyErr_Occurred()) goto python_error;
    snprintf(k->node, sizeof k->node, "%s", node);
  } else {
    status = status_from_result(result, "", "reading the node's attributes");
    if (status == NULL) status = make_status(ORT_FAIL, "mha_ep %s: describe_kernel answered nothing", k->op_name);
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
  if (k == NULL) return make_status(ORT_FAIL, "mha_ep %s: out of host memory", op_name(op));
  const OpVariant* variant = (const OpVariant*)op;
  k->ep = variant->ep;
  k->op = variant->kind;
  k->op_name = OP_NAMES[variant->kind];
  k->n_inputs = (int)op_input_count(op);
  k->n_outputs = (int)op_output_count(op);
  OrtStatus* status = describe_kernel(info, k);
  if (status == NULL && k->ep == EP_CUDA) {
    if (!load_cuda()) {
      status = make_status(ORT_EP_FAIL, "mha_ep %s node '%s': %s", k->op_name, k->node, cu.error);
    } else {
      status = API(KernelInfoGetAllocatorFn, API_KernelInfoGetAllocator)(info, MEM_TYPE_DEFAULT, &k->allocator);
      if (status == NULL) {
        k->memory = k->allocator->Info(k->allocator);
        status = API(MemoryInfoGetIdFn, API_MemoryInfoGetId)(k->memory, &k->device);
      }
      CUdevice device;
      if (status == NULL && (cu.cuDeviceGet(&device, k->device) != 0 ||
                             cu.cuDevicePrimaryCtxRetain(&k->context, device) != 0)) {
        status = make_status(ORT_EP_FAIL, "mha_ep %s node '%s': CUDA device %d has no context",
                             k->op_name, k->node, k->device);
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

static OrtStatus* kernel_compute(void* opaque, OrtKernelContext* context) {
  Kernel* k = opaque;
  return k->ep == EP_CUDA ? compute_cuda(k, context) : compute_cpu(k, context);
}

/* --------------------------------------------------------------------------------- ops and registration */
static const int FLOAT_TYPES[] = {ELEM_FLOAT, ELEM_FLOAT16, ELEM_BFLOAT16};
static const int MASK_TYPES[] = {ELEM_INT32, ELEM_INT64};
#define MHA_VARIANTS 6    /* float type x mask type */
#define MATMUL_VARIANTS 3 /* float type */
#define VARIANTS_PER_EP (MHA_VARIANTS + MATMUL_VARIANTS)
static OpVariant g_ops[2][VARIANTS_PER_EP];
static OrtCustomOpDomain* g_domains[2]; /* [0]: CPU kernels only; [1]: CPU and CUDA kernels. Never released: a
                                           domain must outlive every session made from options holding it. */
static pthread_mutex_t g_domain_lock = PTHREAD_MUTEX_INITIALIZER;

static void init_ops(void) {
  for (int ep = 0; ep < 2; ++ep) {
    for (int i = 0; i < VARIANTS_PER_EP; ++i) {
      OpVariant* v = &g_ops[ep][i];
      memset(v, 0, sizeof *v);
      v->ep = ep;
      v->kind = i < MHA_VARIANTS ? OP_MHA : OP_MATMUL;
      v->float_type = FLOAT_TYPES[i < MHA_VARIANTS ? i / 2 : i - MHA_VARIANTS];
      v->mask_type = i < MHA_VARIANTS ? MASK_TYPES[i % 2] : 0;
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
