/* cuda_compute.c: a CUDA kernel's compute, without Python on a repeated call signature: the signature looked up
 * in the plan cache (plans.c; a missing plan made by the Python planner under the GIL), ORT's input, output and
 * scratch pointers bound into the plan, and its steps run on ORT's stream with the CUDA driver: kernel launches
 * (with their TMA tensor maps encoded), cuBLAS GEMMs, copies, fills, and an eager call's status check. */
#include "native.h"

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
    *status = make_status(ORT_FAIL, "mha_ep %s node '%s': no plan for this call signature, and "
                          "the interpreter that makes plans is shutting down", k->op_name, k->node);
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
    if (*status == NULL) *status = make_status(ORT_FAIL, "mha_ep %s node '%s': no plan", k->op_name, k->node);
    goto done;
  }
  Py_ssize_t size = PyBytes_Size(result);
  if (size % 8) {
    *status = make_status(ORT_FAIL, "mha_ep %s node '%s': a plan of %zd bytes", k->op_name, k->node, size);
    goto done;
  }
  char error[512];
  plan = parse_plan((const int64_t*)PyBytes_AsString(result), size / 8, error, sizeof error);
  if (plan == NULL) {
    *status = make_status(ORT_FAIL, "mha_ep %s node '%s': %s", k->op_name, k->node, error);
    goto done;
  }
  if (!set_plan_key(plan, key, length, hash)) {
    free_plan(plan);
    plan = NULL;
    *status = make_status(ORT_FAIL, "mha_ep %s node '%s': out of host memory", k->op_name, k->node);
    goto done;
  }
done:
  Py_XDECREF(result);
  PyGILState_Release(gil);
  leave_python();
  return plan == NULL ? NULL : insert_plan(plan);
}

static OrtStatus* launch_error(const Kernel* k, const char* what, CUresult result) {
  return make_status(ORT_EP_FAIL, "mha_ep %s node '%s': %s failed on CUDA device %d: %s (CUresult %d)",
                     k->op_name, k->node, what, k->device, cu_error_text(result), result);
}

/* Whether step i fills the status words a later STEP_CHECK_STATUS reads. Under a capture that check is skipped
 * (the graph reports through the sticky words), so the fill is too: a memset node a shared-buffer layer a step. */
static int fills_checked_status(const Plan* plan, int64_t i) {
  const Ref* dst = &plan->steps[i].dst;
  for (int64_t j = i + 1; j < plan->n_steps; ++j) {
    const Ref* read = &plan->steps[j].dst;
    if (plan->steps[j].kind == STEP_CHECK_STATUS && read->space == dst->space && read->index == dst->index &&
        read->add == dst->add) {
      return 1;
    }
  }
  return 0;
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
          return make_status(ORT_EP_FAIL, "mha_ep %s node '%s': the CUDA driver has no "
                             "cuTensorMapEncodeTiled (TMA maps need a CUDA 12 or newer driver)", k->op_name, k->node);
        }
        result = cu.cuTensorMapEncodeTiled(arguments + map->offset, (int)map->dtype, (uint32_t)map->rank,
                                           (void*)(uintptr_t)resolve(bases, map->ref), map->dims, map->strides,
                                           map->box, map->element_strides, (int)map->interleave, (int)map->swizzle,
                                           (int)map->l2, (int)map->oob);
        if (result != 0) return launch_error(k, "encoding a TMA tensor map", result);
      }
      for (int64_t a = 0; a < s->n_args; ++a) parameters[a] = arguments + s->arg_offsets[a];
      if (s->programmatic && cu.cuLaunchKernelEx != NULL) {
        CUlaunchAttribute attribute;
        memset(&attribute, 0, sizeof attribute);
        attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attribute.value.programmaticStreamSerializationAllowed = 1;
        CUlaunchConfig config = {s->grid[0], s->grid[1], s->grid[2], s->block[0], s->block[1], s->block[2],
                                 s->shared, stream, &attribute, 1};
        result = cu.cuLaunchKernelEx(&config, s->function, parameters, NULL);
      } else {
        result = cu.cuLaunchKernel(s->function, s->grid[0], s->grid[1], s->grid[2], s->block[0], s->block[1],
                                   s->block[2], s->shared, stream, parameters, NULL);
      }
      if (result != 0) return launch_error(k, "a kernel launch", result);
    } else if (s->kind == STEP_GEMM) {
      if (!load_cublas()) return make_status(ORT_EP_FAIL, "mha_ep %s node '%s': %s", k->op_name, k->node, cublas.error);
      if (cublas_handle == NULL) {
        OrtStatus* status = API(GetResourceFn, API_KernelContext_GetResource)(
            context, CUDA_RESOURCE_VERSION, CUDA_RESOURCE_CUBLAS_HANDLE, &cublas_handle);
        if (status != NULL) {
          char text[512];
          status_text(status, text, sizeof text);
          return make_status(ORT_EP_FAIL, "mha_ep %s node '%s': ORT's cuBLAS handle: %s", k->op_name, k->node, text);
        }
      }
      const float beta = 0.0f;
      int done = cublas.gemm(cublas_handle, (int)s->trans_a, (int)s->trans_b, (int)s->m, (int)s->n, (int)s->k,
                             &s->alpha, (const void*)(uintptr_t)resolve(bases, s->a), (int)s->a_type, (int)s->lda,
                             s->stride_a, (const void*)(uintptr_t)resolve(bases, s->b), (int)s->b_type, (int)s->ldb,
                             s->stride_b, &beta, (void*)(uintptr_t)resolve(bases, s->c), 0 /* CUDA_R_32F */,
                             (int)s->ldc, s->stride_c, (int)s->batch, (int)s->compute, -1 /* CUBLAS_GEMM_DEFAULT */);
      if (done != 0) {
        return make_status(ORT_EP_FAIL, "mha_ep %s node '%s': cublasGemmStridedBatchedEx failed "
                           "(cublasStatus %d)", k->op_name, k->node, done);
      }
    } else if (s->kind == STEP_COPY) {
      uint64_t dst = resolve(bases, s->dst), src = resolve(bases, s->src); /* equal: a present bound to its past */
      if (s->nbytes && dst != src) result = cu.cuMemcpyAsync(dst, src, (size_t)s->nbytes, stream);
      if (result != 0) return launch_error(k, "a device copy", result);
    } else if (s->kind == STEP_FILL) {
      if (bases->sticky != NULL && fills_checked_status(plan, i)) continue; /* capturing: nothing reads them */
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
        return make_status(ORT_INVALID_ARGUMENT, "mha_ep %s node '%s': %s", k->op_name, k->node, text);
      }
    }
  }
  return NULL;
}

OrtStatus* compute_cuda(Kernel* k, OrtKernelContext* context) {
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
  for (int slot = 0; slot < k->n_inputs; ++slot) {
    if (!(k->supplied & (1u << slot))) continue;
    OrtStatus* status = read_input(context, (size_t)slot, &tensors[slot], k->node);
    if (status != NULL) return status;
    const Tensor* t = &tensors[slot];
    bases.input[slot] = t->data;
    length = append_slot_key(key, length, slot, t->type, t->rank, t->dims, alignment_log2(t->data));
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
      note_hit(plan);
    } else {
      plan = make_plan(k, tensors, flags, key, length, hash, &status);
      if (plan == NULL) return status;
    }
    for (int o = 0; o < k->n_outputs; ++o) { /* a plan holds MAX_OUTPUTS shapes: the op's first n_outputs */
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
    for (int o = 0; o < k->n_outputs; ++o) {
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
      status = make_status(ORT_EP_FAIL, "mha_ep %s node '%s': no scratch buffer of %lld bytes",
                           k->op_name, k->node, (long long)plan->scratch_bytes);
    }
  }
  if (status == NULL) status = run_plan(k, plan, &bases, stream, context);
  /* ORT's arena orders reuse of the scratch by the stream it was taken on, as for its own kernels' scratch. */
  if (bases.scratch != NULL) k->allocator->Free(k->allocator, bases.scratch);
  if (switched) cu.cuCtxSetCurrent(previous);
  release_plan(plan);
  return status;
}
