/* reports.c: a shared-buffer kernel's reports (kernels/shared_buffer.cu's status words): their sentence, for an
 * eager call's status (cuda_compute.c) and for Python (device_error_text), and each device's sticky report words,
 * which a replayed CUDA graph writes instead (error_words, take_device_error). */
#include "native.h"

/* The sticky report words of each device (STATUS_WORDS int32 of device memory), allocated once by error_words (the
 * planner calls it, before ORT could capture a graph) and kept for the life of the process: captured graphs hold
 * their address. take_device_error reads and clears them. */
CUdeviceptr g_error_device[MAX_DEVICES];

/* The sentence of a shared-buffer kernel's report (mha_ep/launch.py device_error_text words it the same). */
void device_error_text(const int32_t* w, int64_t beams, char* out, size_t size) {
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
PyObject* py_error_words(PyObject* self, PyObject* args) {
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
PyObject* py_take_device_error(PyObject* self, PyObject* args) {
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

/* device_error_text(code, a, b, c, beams) -> the C side's sentence (tests compare it with launch.py's). */
PyObject* py_device_error_text(PyObject* self, PyObject* args) {
  (void)self;
  int32_t words[STATUS_WORDS] = {0};
  long long beams;
  if (!PyArg_ParseTuple(args, "iiiiL", &words[0], &words[1], &words[2], &words[3], &beams)) return NULL;
  char text[512];
  device_error_text(words, beams, text, sizeof text);
  return PyUnicode_FromString(text);
}
