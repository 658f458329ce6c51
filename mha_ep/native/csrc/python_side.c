/* python_side.c: the Python side of the library: the callbacks configure() hands in (the kernel describer, the
 * planner, the CPU compute), the guard around every entry into Python (enter_python, leave_python; shutdown() closes
 * it at exit), and a Python error or answer as an ORT status. */
#include "native.h"

PyObject* g_describe = NULL;    /* describe_kernel(attributes: dict, ep: str) -> (config id, node name) */
PyObject* g_planner = NULL;     /* plan(config id, node name, device, flags, inputs) -> bytes | (code, str) */
PyObject* g_cpu_compute = NULL; /* compute(config id, node name, inputs, token) -> None | (code, str) */
PyObject* g_attributes = NULL;  /* ((name, kind), ...): the attributes a kernel reads from its node */
static atomic_int g_finalizing = 0;

/* The pending Python exception as an ORT status (the exception is cleared). A KeyboardInterrupt is put back as a
 * pending interrupt, so that the caller's thread sees it once ORT's run has returned. Call with the GIL. */
OrtStatus* status_from_python_error(const char* node, const char* what) {
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
OrtStatus* status_from_result(PyObject* result, const char* node, const char* what) {
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

int enter_python(void) {
  atomic_fetch_add(&g_inside_python, 1);
  if (!atomic_load(&g_finalizing) && Py_IsInitialized()) return 1;
  atomic_fetch_sub(&g_inside_python, 1);
  return 0;
}

void leave_python(void) { atomic_fetch_sub(&g_inside_python, 1); }

PyObject* py_configure(PyObject* self, PyObject* args) {
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

PyObject* py_shutdown(PyObject* self, PyObject* args) {
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
