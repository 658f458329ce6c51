/* replay.c: a graph replay's copies, from Python: what serves a graph session's replay around ORT's run, not the
 * op (and driver_error, which says whether they can run).
 *
 * launch_copies (mha_ep/gpu_session/segments.py; ONE_STREAM_REPLAY in gpu_session/slots.py): one call queues what a
 * graph session's replay does around ORT's run on ORT's stream, with the driver and no Python in between: ORT's
 * stream waits for the caller's (an event), the copy kernel copies a table's segments, and the caller's stream waits
 * for ORT's (another event). CuPy's launch of the same kernel and its event calls cost several times the driver's
 * own (docs/BENCH.md). */
#include "native.h"

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
PyObject* py_launch_copies(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
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
PyObject* py_driver_error(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  if (load_cuda()) Py_RETURN_NONE;
  return PyUnicode_FromString(cu.error);
}
