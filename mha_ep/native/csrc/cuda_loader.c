/* cuda_loader.c: the CUDA libraries, opened with dlopen on first use (no CUDA header or toolkit at build time):
 * the driver (libcuda.so.1) into the table ``cu``, and cuBLAS's strided-batched GemmEx (``cublas``), the copy ORT's
 * CUDA provider loaded. Their types are native.h's. */
#include "native.h"

CudaDriver cu;
Cublas cublas;
pthread_mutex_t g_library_lock = PTHREAD_MUTEX_INITIALIZER;

static void* symbol(void* library, const char* name, const char* fallback) {
  void* found = dlsym(library, name);
  if (found == NULL && fallback != NULL) found = dlsym(library, fallback);
  return found;
}

/* 1 when libcuda is loaded (cu.error says why not otherwise). */
int load_cuda(void) {
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
      CU_SYMBOL(cuLaunchKernelEx, "cuLaunchKernelEx", NULL);
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
int load_cublas(void) {
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

const char* cu_error_text(CUresult result) {
  const char* text = NULL;
  if (cu.cuGetErrorString == NULL || cu.cuGetErrorString(result, &text) != 0 || text == NULL) return "unknown";
  return text;
}
