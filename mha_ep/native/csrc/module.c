/* module.c: the CPython extension module ``_native``: its methods' table, PyInit__native, and the methods that
 * tell how the library was built (layout, ordinals, source_sha256). The other methods are defined beside what they
 * serve: configure and shutdown in python_side.c, check_plan, stats, clear_plans, signature_key, add_plan and
 * has_plan in plans.c, kernel_output in cpu_compute.c, error_words, take_device_error and device_error_text in
 * reports.c, launch_copies and driver_error in replay.c. */
#include "native.h"

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

/* MHA_EP_SOURCE_SHA256: the SHA-256 of the library's sources (every .c and .h of mha_ep/native/csrc, by the rule
 * of source_sha256 in setup.py and mha_ep/native/__init__.py) as setup.py built it (mha_ep/native/__init__.py
 * refuses a library built from other sources than the csrc/ beside it); "" when built without setup.py. */
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
    {"signature_key", py_signature_key, METH_VARARGS,
     "signature_key(config, device, flags, inputs) -> bytes: the plan cache's key of a call signature"},
    {"add_plan", py_add_plan, METH_VARARGS,
     "add_plan(key, plan) -> bool: cache a plan made ahead (False: one was there)"},
    {"has_plan", py_has_plan, METH_VARARGS, "has_plan(key) -> bool: whether the cache holds a plan for key"},
    {"shutdown", py_shutdown, METH_NOARGS, "shutdown(): no Python callback from now on (atexit)"},
    {"layout", py_layout, METH_NOARGS, "layout() -> dict: the ABI layout this library was built with"},
    {"ordinals", py_ordinals, METH_NOARGS, "ordinals() -> dict: the OrtApi ordinals this library calls"},
    {"source_sha256", py_source_sha256, METH_NOARGS, "source_sha256() -> the SHA-256 of the csrc/ sources it was built from"},
    {"launch_copies", (PyCFunction)(void (*)(void))py_launch_copies, METH_FASTCALL,
     "launch_copies(device, function, grid_x, grid_y, block_x, table, column, stream, addresses, wait_event, "
     "wait_stream, signal_event, signal_stream): a graph replay's copies and events on ORT's stream"},
    {"driver_error", py_driver_error, METH_NOARGS, "driver_error() -> None where the CUDA driver loads, else why not"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_native", "mha_ep's native custom-op library", -1, METHODS,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&MODULE); }
