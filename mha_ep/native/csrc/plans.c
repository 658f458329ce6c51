/* plans.c: plans (their format and types are native.h's): an encoded plan parsed and checked, the process-wide
 * plan cache a CUDA kernel's compute looks a call signature up in (cuda_compute.c), and the module's methods that
 * read them (check_plan, stats, clear_plans). */
#include "native.h"

void free_plan(Plan* plan) {
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

void release_plan(Plan* plan) {
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
Plan* parse_plan(const int64_t* words, int64_t count, char* error, size_t error_size) {
  Reader r = {words, count, 0, {0}};
  Plan* plan = calloc(1, sizeof(Plan));
  if (plan == NULL) {
    snprintf(error, error_size, "out of host memory");
    return NULL;
  }
  atomic_init(&plan->refs, 1);
  atomic_init(&plan->ahead, 0);
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
      case STEP_LAUNCH_PROGRAMMATIC:
        ok = read_launch(&r, s);
        s->kind = STEP_LAUNCH;
        s->programmatic = 1;
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
#define MAX_PLANS 4096
static Plan* g_buckets[BUCKETS];
static int64_t g_plan_count = 0;
static pthread_mutex_t g_plan_lock = PTHREAD_MUTEX_INITIALIZER;
atomic_llong g_hits, g_misses;
static atomic_llong g_evictions;
static atomic_llong g_ahead_added, g_ahead_used; /* plans made ahead (add_plan), and those a call then used */

int64_t append_slot_key(int64_t* key, int64_t length, int slot, int64_t type, size_t rank, const int64_t* dims,
                        int alignment_log2) {
  key[length++] = slot;
  key[length++] = type;
  key[length++] = (int64_t)rank;
  for (size_t d = 0; d < rank; ++d) key[length++] = dims[d];
  key[length++] = alignment_log2;
  return length;
}

/* A call found ``plan`` in the cache: a hit, and the first use of a plan made ahead. */
void note_hit(Plan* plan) {
  atomic_fetch_add(&g_hits, 1);
  if (atomic_load(&plan->ahead) && atomic_exchange(&plan->ahead, 0)) atomic_fetch_add(&g_ahead_used, 1);
}

uint64_t hash_key(const int64_t* key, int64_t length) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0; i < length; ++i) {
    h ^= (uint64_t)key[i];
    h *= 1099511628211ull;
    h ^= h >> 29;
  }
  return h;
}

Plan* lookup_plan(const int64_t* key, int64_t length, uint64_t hash) {
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
Plan* insert_plan(Plan* plan) {
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

/* Give ``plan`` its cache key (a copy of ``key``) and the key's hash; 0 when out of host memory (the plan is left
 * as it was, for the caller to free). */
int set_plan_key(Plan* plan, const int64_t* key, int64_t length, uint64_t hash) {
  plan->key = malloc((size_t)length * 8);
  if (plan->key == NULL) return 0;
  memcpy(plan->key, key, (size_t)length * 8);
  plan->key_length = length;
  plan->hash = hash;
  return 1;
}

/* An encoded plan handed over from Python as bytes, parsed; NULL with a Python error set when it is not a whole
 * number of words, is malformed (ValueError naming what), or memory runs out. */
static Plan* plan_from_bytes(const char* data, Py_ssize_t size) {
  if (size % 8) {
    PyErr_SetString(PyExc_ValueError, "a plan is a whole number of 8-byte words");
    return NULL;
  }
  int64_t* words = malloc((size_t)size + 8); /* an aligned copy of the bytes */
  if (words == NULL) {
    PyErr_NoMemory();
    return NULL;
  }
  memcpy(words, data, (size_t)size);
  char error[512];
  Plan* plan = parse_plan(words, size / 8, error, sizeof error);
  free(words);
  if (plan == NULL) PyErr_SetString(PyExc_ValueError, error);
  return plan;
}

/* check_plan(bytes) -> dict: parse an encoded plan as a call would (CPU tests of the encoder and the parser). */
PyObject* py_check_plan(PyObject* self, PyObject* args) {
  (void)self;
  const char* data;
  Py_ssize_t length;
  if (!PyArg_ParseTuple(args, "y#", &data, &length)) return NULL;
  Plan* plan = plan_from_bytes(data, length);
  if (plan == NULL) return NULL;
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
                          ? Py_BuildValue("{s:s,s:K,s:(III),s:(III),s:I,s:L,s:L,s:L,s:L}", "kind", KINDS[s->kind],
                                          "function", (unsigned long long)(uintptr_t)s->function, "grid", s->grid[0],
                                          s->grid[1], s->grid[2], "block", s->block[0], s->block[1], s->block[2],
                                          "shared", s->shared, "arguments", (long long)s->n_args, "patches",
                                          (long long)s->n_patches, "maps", (long long)s->n_maps, "programmatic",
                                          (long long)s->programmatic)
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

PyObject* py_stats(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  pthread_mutex_lock(&g_plan_lock);
  long long plans = (long long)g_plan_count;
  pthread_mutex_unlock(&g_plan_lock);
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L}", "plans", plans, "hits", (long long)atomic_load(&g_hits),
                       "misses", (long long)atomic_load(&g_misses), "evictions", (long long)atomic_load(&g_evictions),
                       "ahead", (long long)atomic_load(&g_ahead_added), "ahead_used",
                       (long long)atomic_load(&g_ahead_used));
}

/* A key's words from bytes (a whole number of 8-byte words, at most MAX_KEY); 0 with a Python error if not. */
static int key_words(const char* data, Py_ssize_t size, int64_t* key, int64_t* length) {
  if (size <= 0 || size % 8 || size / 8 > MAX_KEY) {
    PyErr_Format(PyExc_ValueError, "a plan key is 1 to %d whole 8-byte words, got %zd bytes", MAX_KEY, size);
    return 0;
  }
  memcpy(key, data, (size_t)size);
  *length = size / 8;
  return 1;
}

/* signature_key(config, device, flags, inputs) -> bytes: the key compute_cuda would look a call up with, for the
 * inputs as the planner receives them (per slot None or (element type, dims, alignment log2)). */
PyObject* py_signature_key(PyObject* self, PyObject* args) {
  (void)self;
  long long config, device, flags;
  PyObject* inputs;
  if (!PyArg_ParseTuple(args, "LLLO", &config, &device, &flags, &inputs)) return NULL;
  if (!PyTuple_Check(inputs) || PyTuple_Size(inputs) != MAX_INPUTS) {
    PyErr_Format(PyExc_ValueError, "inputs must be a tuple of %d slots", MAX_INPUTS);
    return NULL;
  }
  int64_t key[MAX_KEY];
  int64_t length = 0;
  key[length++] = config;
  key[length++] = device;
  key[length++] = flags;
  for (int slot = 0; slot < MAX_INPUTS; ++slot) {
    PyObject* entry = PyTuple_GetItem(inputs, slot);
    if (entry == Py_None) continue;
    long long type;
    int alignment;
    PyObject* dims;
    if (!PyArg_ParseTuple(entry, "LO!i", &type, &PyTuple_Type, &dims, &alignment)) return NULL;
    Py_ssize_t rank = PyTuple_Size(dims);
    if (rank > MAX_RANK) {
      PyErr_Format(PyExc_ValueError, "input slot %d has rank %zd, more than %d", slot, rank, MAX_RANK);
      return NULL;
    }
    int64_t values[MAX_RANK];
    for (Py_ssize_t d = 0; d < rank; ++d) {
      values[d] = PyLong_AsLongLong(PyTuple_GetItem(dims, d));
      if (values[d] == -1 && PyErr_Occurred()) return NULL;
    }
    length = append_slot_key(key, length, slot, type, (size_t)rank, values, alignment);
  }
  return PyBytes_FromStringAndSize((const char*)key, (Py_ssize_t)length * 8);
}

/* add_plan(key, plan) -> bool: parse an encoded plan and cache it under key, marked as made ahead; False when the
 * cache holds a plan for key already (that one stays). */
PyObject* py_add_plan(PyObject* self, PyObject* args) {
  (void)self;
  const char *key_data, *data;
  Py_ssize_t key_size, size;
  if (!PyArg_ParseTuple(args, "y#y#", &key_data, &key_size, &data, &size)) return NULL;
  int64_t key[MAX_KEY];
  int64_t length;
  if (!key_words(key_data, key_size, key, &length)) return NULL;
  Plan* plan = plan_from_bytes(data, size);
  if (plan == NULL) return NULL;
  if (!set_plan_key(plan, key, length, hash_key(key, length))) {
    free_plan(plan);
    return PyErr_NoMemory();
  }
  atomic_store(&plan->ahead, 1);
  atomic_fetch_add(&plan->refs, 1); /* held across insert_plan, so that the comparison below reads a live plan */
  Plan* used = insert_plan(plan);
  int added = used == plan;
  release_plan(used);
  release_plan(plan);
  if (added) atomic_fetch_add(&g_ahead_added, 1);
  return PyBool_FromLong(added);
}

/* has_plan(key) -> bool */
PyObject* py_has_plan(PyObject* self, PyObject* args) {
  (void)self;
  const char* key_data;
  Py_ssize_t key_size;
  if (!PyArg_ParseTuple(args, "y#", &key_data, &key_size)) return NULL;
  int64_t key[MAX_KEY];
  int64_t length;
  if (!key_words(key_data, key_size, key, &length)) return NULL;
  Plan* plan = lookup_plan(key, length, hash_key(key, length));
  release_plan(plan);
  return PyBool_FromLong(plan != NULL);
}

PyObject* py_clear_plans(PyObject* self, PyObject* args) {
  (void)self;
  (void)args;
  pthread_mutex_lock(&g_plan_lock);
  clear_plans_locked();
  pthread_mutex_unlock(&g_plan_lock);
  Py_RETURN_NONE;
}
