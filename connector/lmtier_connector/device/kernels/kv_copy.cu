// lmtier: fused multi-layer copies between paged KV and chunk buffers.
//
// One launch moves the blocks of a set of chunks for a range of layers: every layer's
// pages (one base address per layer, all with the same strides), every K/V half,
// every token (or, for paged chunks, every block row) of every chunk. The chunk side
// is any memory the device can address: device memory, or pinned host memory read
// and written in place over the bus (zero-copy).
//
// The work of chunk c (grid row blockIdx.y) is a flat index i over
//     (layer, pair, token, row, unit)    sizes (num_layers, pairs, tokens_c, rows, units)
// where a unit is one vector V (16, 8, 4, 2 or 1 bytes), a row is `units` vectors
// that are contiguous on both sides, and token t lives in slot t % slots of block
// ids[t / slots] of the run. With byte strides (page_*, chunk_*) and the chunk's own
// row of `table` (its address, token count, first id, layer and pair strides):
//
//     page  = layers[layer0 + l] + k*page_pair + ids[b]*page_block + s*page_slot
//             + h*page_row + u*sizeof(V)
//     chunk = table.address + (layer0 + l)*table.layer + k*table.pair + b*chunk_block
//             + s*chunk_slot + h*chunk_row + u*sizeof(V)
//
// lmtier_connector/device/kernels/plan.py builds the arguments (and proves them against
// the torch path on the CPU through its reference of this arithmetic); the host checks
// that every address and stride is a multiple of sizeof(V) and that the flat index of
// every chunk fits 31 bits. The file includes nothing, so that it also compiles as
// C++ once the CUDA keywords and built-ins are defined: the tests run it on the CPU,
// with LMTIER_COPY checking that every unit lies inside the tensors it may touch.

#ifndef LMTIER_COPY  // the tests' C++ build checks every address here
#define LMTIER_COPY(V, dst, src) (*(V*)(dst) = *(const V*)(src))
#endif

typedef long long i64;
typedef unsigned int u32;

#define LMTIER_TABLE_ROW 5  // address, tokens, first id, layer stride, pair stride

template <typename V, bool kSave>
__device__ __forceinline__ void lmtier_kv_copy(
    const i64* __restrict__ layers, const i64* __restrict__ table,
    const i64* __restrict__ ids, int layer0, int num_layers, int pairs, int slots,
    int rows, int units, i64 page_pair, i64 page_block, i64 page_slot, i64 page_row,
    i64 chunk_block, i64 chunk_slot, i64 chunk_row) {
    const i64* chunk_row_of_table = table + (i64)LMTIER_TABLE_ROW * blockIdx.y;
    const i64 address = chunk_row_of_table[0];
    const u32 tokens = (u32)chunk_row_of_table[1];
    const i64* run = ids + chunk_row_of_table[2];
    const i64 chunk_layer = chunk_row_of_table[3];
    const i64 chunk_pair = chunk_row_of_table[4];
    const u32 work = (u32)num_layers * (u32)pairs * tokens * (u32)rows * (u32)units;
    const u32 step = gridDim.x * blockDim.x;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < work; i += step) {
        u32 rest = i;
        const u32 u = rest % (u32)units;
        rest /= (u32)units;
        const u32 h = rest % (u32)rows;
        rest /= (u32)rows;
        const u32 t = rest % tokens;
        rest /= tokens;
        const u32 k = rest % (u32)pairs;
        const u32 l = rest / (u32)pairs;
        const u32 b = t / (u32)slots;
        const u32 s = t % (u32)slots;
        const i64 layer = (i64)layer0 + l;
        char* page = (char*)layers[layer] + k * page_pair + run[b] * page_block +
                     s * page_slot + h * page_row + (i64)u * (i64)sizeof(V);
        char* chunk = (char*)address + layer * chunk_layer + k * chunk_pair + b * chunk_block +
                      s * chunk_slot + h * chunk_row + (i64)u * (i64)sizeof(V);
        if (kSave) {
            LMTIER_COPY(V, chunk, page);
        } else {
            LMTIER_COPY(V, page, chunk);
        }
    }
}

#define LMTIER_KV_KERNEL(NAME, V, SAVE)                                                     \
    extern "C" __global__ void NAME(                                                       \
        const i64* __restrict__ layers, const i64* __restrict__ table,                     \
        const i64* __restrict__ ids, int layer0, int num_layers, int pairs, int slots,     \
        int rows, int units, i64 page_pair, i64 page_block, i64 page_slot, i64 page_row,   \
        i64 chunk_block, i64 chunk_slot, i64 chunk_row) {                                  \
        lmtier_kv_copy<V, SAVE>(layers, table, ids, layer0, num_layers, pairs, slots, rows, \
                                units, page_pair, page_block, page_slot, page_row,         \
                                chunk_block, chunk_slot, chunk_row);                       \
    }

// Save: pages -> chunk. Load: chunk -> pages. One kernel per vector width.
LMTIER_KV_KERNEL(lmtier_kv_save_16, uint4, true)
LMTIER_KV_KERNEL(lmtier_kv_save_8, uint2, true)
LMTIER_KV_KERNEL(lmtier_kv_save_4, unsigned int, true)
LMTIER_KV_KERNEL(lmtier_kv_save_2, unsigned short, true)
LMTIER_KV_KERNEL(lmtier_kv_save_1, unsigned char, true)
LMTIER_KV_KERNEL(lmtier_kv_load_16, uint4, false)
LMTIER_KV_KERNEL(lmtier_kv_load_8, uint2, false)
LMTIER_KV_KERNEL(lmtier_kv_load_4, unsigned int, false)
LMTIER_KV_KERNEL(lmtier_kv_load_2, unsigned short, false)
LMTIER_KV_KERNEL(lmtier_kv_load_1, unsigned char, false)
