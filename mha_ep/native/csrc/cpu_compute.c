/* cpu_compute.c: a CPU kernel's compute: ORT's host buffers handed to the Python callback without a copy, and
 * kernel_output, through which that callback asks ORT for an output buffer (only inside the callback, on its
 * thread). */
#include "native.h"

static __thread OrtKernelContext* t_active_context = NULL; /* the CPU compute callback's context on this thread */

OrtStatus* compute_cpu(Kernel* k, OrtKernelContext* context) {
  Tensor tensors[MAX_INPUTS];
  memset(tensors, 0, sizeof tensors);
  for (int slot = 0; slot < k->n_inputs; ++slot) {
    if (!(k->supplied & (1u << slot))) continue;
    OrtStatus* status = read_input(context, (size_t)slot, &tensors[slot], k->node);
    if (status != NULL) return status;
  }
  if (g_cpu_compute == NULL || !enter_python()) {
    return make_status(ORT_FAIL, "mha_ep %s node '%s': the interpreter is shutting down", k->op_name, k->node);
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

/* kernel_output(token, index, dims) -> address of ORT's output buffer: only inside the CPU compute callback. */
PyObject* py_kernel_output(PyObject* self, PyObject* args) {
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
