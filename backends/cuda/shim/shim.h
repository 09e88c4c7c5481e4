// The host shim: CUDA kernel sources compiled as ordinary C++ (g++, C++17), so that their
// numerics can be checked on a machine without a GPU. A launch runs the grid's blocks one
// after the other; within a block, the threads run one after the other (kernels without
// __syncthreads) or as cooperative fibers that switch at every __syncthreads (ucontext), so
// shared-memory reductions run exactly as written. __shared__ variables become statics,
// which is correct because one block runs at a time and launches are serialized.
#pragma once
#define SCHEDC_SHIM 1
#include <math.h>
#include <string.h>

struct dim3 {
    unsigned x, y, z;
};

// Set by the launcher before a thread (fiber) runs.
extern dim3 threadIdx;
extern dim3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

void __syncthreads();
// Reports an error from a kernel (the launch fails with this message).
void schedc_shim_fail(const char* why);

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define KERNEL void
#define DEV inline
#define SHARED static

inline float schedc_bits_to_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned schedc_float_to_bits(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
