/* ort_abi.h: the subset of ONNX Runtime's C ABI this library calls, declared here instead of taken from
 * onnxruntime_c_api.h (no ORT header is needed to build): the opaque types, struct OrtCustomOp field for field, the
 * OrtApi ordinals and the function types called through them, and the CUDA provider's resource ids. How the table is
 * held and called (g_api, API) is native.h's. */
#ifndef MHA_EP_ORT_ABI_H
#define MHA_EP_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

#define ORT_API_USED 18 /* KernelContext_GetScratchBuffer and KernelInfoGetAllocator: ORT 1.18 */
#define OP_VERSION 18

typedef struct OrtStatus OrtStatus;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtMemoryInfo OrtMemoryInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef struct OrtApi OrtApi;

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

typedef struct OrtAllocator {
  uint32_t version;
  void* (*Alloc)(struct OrtAllocator* self, size_t size);
  void (*Free)(struct OrtAllocator* self, void* p);
  const OrtMemoryInfo* (*Info)(const struct OrtAllocator* self);
} OrtAllocator;

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, ORT_RUNTIME_EXCEPTION = 6, ORT_EP_FAIL = 11 };
enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT32 = 6, ELEM_INT64 = 7, ELEM_FLOAT16 = 10, ELEM_BFLOAT16 = 16 };
enum { CHARACTERISTIC_REQUIRED = 0 };
enum { MEM_TYPE_DEFAULT = 0 };

/* struct OrtCustomOp, field for field (onnxruntime_c_api.h; fields after GetVariadicOutputHomogeneity were added
 * in versions 16-18 and are read by ORT only for ops of those versions). */
typedef struct OrtCustomOp OrtCustomOp;
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  int (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  int (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp* op, OrtShapeInferContext* context);
  int (*GetStartVersion)(const OrtCustomOp* op);
  int (*GetEndVersion)(const OrtCustomOp* op);
  size_t (*GetMayInplace)(int** input_index, int** output_index);
  void (*ReleaseMayInplace)(int* input_index, int* output_index);
  size_t (*GetAliasMap)(int** input_index, int** output_index);
  void (*ReleaseAliasMap)(int* input_index, int* output_index);
};

/* OrtApi ordinals used (tests/native/test_native_abi.py holds the same table, read off onnxruntime_c_api.h of API version 29,
 * and compares the two through ordinals()). */
enum {
  API_CreateStatus = 0,
  API_GetErrorMessage = 2,
  API_CreateCustomOpDomain = 26,
  API_CustomOpDomain_Add = 27,
  API_AddCustomOpDomain = 28,
  API_GetTensorMutableData = 51,
  API_GetTensorElementType = 60,
  API_GetDimensionsCount = 61,
  API_GetDimensions = 62,
  API_GetTensorTypeAndShape = 65,
  API_MemoryInfoGetId = 72,
  API_KernelInfoGetAttribute_float = 85,
  API_KernelInfoGetAttribute_int64 = 86,
  API_KernelInfoGetAttribute_string = 87,
  API_KernelContext_GetInputCount = 88,
  API_KernelContext_GetOutputCount = 89,
  API_KernelContext_GetInput = 90,
  API_KernelContext_GetOutput = 91,
  API_ReleaseStatus = 93,
  API_ReleaseTensorTypeAndShapeInfo = 99,
  API_ReleaseAllocator = 132,
  API_KernelContext_GetGPUComputeStream = 193,
  API_GetSessionConfigEntry = 238,
  API_KernelInfo_GetNodeName = 244,
  API_KernelContext_GetResource = 265,
  API_KernelContext_GetScratchBuffer = 277,
  API_KernelInfoGetAllocator = 278,
};

typedef OrtStatus* (*CreateStatusFn)(int, const char*);
typedef const char* (*GetErrorMessageFn)(const OrtStatus*);
typedef void (*ReleaseStatusFn)(OrtStatus*);
typedef OrtStatus* (*CreateCustomOpDomainFn)(const char*, OrtCustomOpDomain**);
typedef OrtStatus* (*CustomOpDomain_AddFn)(OrtCustomOpDomain*, const OrtCustomOp*);
typedef OrtStatus* (*AddCustomOpDomainFn)(OrtSessionOptions*, OrtCustomOpDomain*);
typedef OrtStatus* (*GetTensorMutableDataFn)(OrtValue*, void**);
typedef OrtStatus* (*GetTensorElementTypeFn)(const OrtTensorTypeAndShapeInfo*, int*);
typedef OrtStatus* (*GetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo*, size_t*);
typedef OrtStatus* (*GetDimensionsFn)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t);
typedef OrtStatus* (*GetTensorTypeAndShapeFn)(const OrtValue*, OrtTensorTypeAndShapeInfo**);
typedef OrtStatus* (*MemoryInfoGetIdFn)(const OrtMemoryInfo*, int*);
typedef OrtStatus* (*GetAttrFloatFn)(const OrtKernelInfo*, const char*, float*);
typedef OrtStatus* (*GetAttrInt64Fn)(const OrtKernelInfo*, const char*, int64_t*);
typedef OrtStatus* (*GetAttrStringFn)(const OrtKernelInfo*, const char*, char*, size_t*);
typedef OrtStatus* (*GetCountFn)(const OrtKernelContext*, size_t*);
typedef OrtStatus* (*GetInputFn)(const OrtKernelContext*, size_t, const OrtValue**);
typedef OrtStatus* (*GetOutputFn)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);
typedef void (*ReleaseInfoFn)(OrtTensorTypeAndShapeInfo*);
typedef void (*ReleaseAllocatorFn)(OrtAllocator*);
typedef OrtStatus* (*GetStreamFn)(const OrtKernelContext*, void**);
typedef OrtStatus* (*GetSessionConfigEntryFn)(const OrtSessionOptions*, const char*, char*, size_t*);
typedef OrtStatus* (*GetNodeNameFn)(const OrtKernelInfo*, char*, size_t*);
typedef OrtStatus* (*GetResourceFn)(const OrtKernelContext*, int, int, void**);
typedef OrtStatus* (*GetScratchBufferFn)(const OrtKernelContext*, const OrtMemoryInfo*, size_t, void**);
typedef OrtStatus* (*KernelInfoGetAllocatorFn)(const OrtKernelInfo*, int, OrtAllocator**);

#define CUDA_RESOURCE_VERSION 1 /* core/providers/cuda/cuda_resource.h: version 1 already had the cuBLAS handle */
#define CUDA_RESOURCE_CUBLAS_HANDLE 10002

#endif /* MHA_EP_ORT_ABI_H */
