// Up to MAX_SEGMENTS device-to-device copies in one launch (mha_ep/gpu_session/segments.py): a graph replay's device feeds
// into its slot's fixed buffers, and its outputs out of them (gpu_session/slots.py). On the host one launch for three
// buffers costs about half of one cudaMemcpyAsync per buffer (docs/BENCH.md, "hostcalls").
//
// The segments come by value, as the kernel's one parameter: the launch copies them, so the host may rewrite its
// table at once. blockIdx.y picks the segment; blockIdx.x and the threads stride over it in 16-byte words where
// both ends of the segment are 16-byte aligned, else in bytes.
#define MAX_SEGMENTS 16

struct Segments {
  unsigned long long src[MAX_SEGMENTS];    // device addresses to read
  unsigned long long dst[MAX_SEGMENTS];    // device addresses to write
  unsigned long long bytes[MAX_SEGMENTS];  // each segment's length
};

extern "C" __global__ void copy_segments(const Segments segments) {
  const unsigned int s = blockIdx.y;
  const unsigned long long n = segments.bytes[s];
  const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  const char* src = reinterpret_cast<const char*>(segments.src[s]);
  char* dst = reinterpret_cast<char*>(segments.dst[s]);
  unsigned long long done = 0;
  if (((segments.src[s] | segments.dst[s]) & 15ull) == 0) {
    const unsigned long long words = n / 16;
    const uint4* from = reinterpret_cast<const uint4*>(src);
    uint4* to = reinterpret_cast<uint4*>(dst);
    for (unsigned long long i = first; i < words; i += step) to[i] = from[i];
    done = words * 16;
  }
  for (unsigned long long i = done + first; i < n; i += step) dst[i] = src[i];
}
