/* inputs.c: a call's inputs: each slot's tensor read off ORT's kernel context (element type, shape, data), the
 * alignment of its data, and the slots as the Python side sees them (inputs_tuple). */
#include "native.h"

OrtStatus* read_input(OrtKernelContext* context, size_t slot, Tensor* t, const char* node) {
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

int alignment_log2(const void* pointer) {
  uintptr_t p = (uintptr_t)pointer;
  int log2 = 0;
  while (log2 < 8 && p && (p & 1) == 0) {
    p >>= 1;
    ++log2;
  }
  return p ? log2 : 8;
}

/* (type, dims, alignment log2) per slot, None for a placeholder, as a tuple. Call with the GIL. */
PyObject* inputs_tuple(const Kernel* k, const Tensor* tensors, int with_data) {
  PyObject* inputs = PyTuple_New(MAX_INPUTS);
  if (inputs == NULL) return NULL;
  for (int slot = 0; slot < MAX_INPUTS; ++slot) {
    PyObject* entry;
    if (slot >= k->n_inputs || !(k->supplied & (1u << slot))) {
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
