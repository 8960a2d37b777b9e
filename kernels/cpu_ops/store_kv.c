/* Writes a step's new K/V rows into the paged cache (the layout paged_attention.c reads). */
#include <stdint.h>
#include <string.h>

/* The step's new K/V rows into their cache slots: key/value [T, Hkv*D] (row strides ks, vs;
 * heads contiguous), caches [num_slots, Hkv*D] viewed flat, slot_mapping [T] int64 with -1 =
 * skip. One memcpy per row and cache, no mask tensor, no host sync. Rejects a slot outside
 * the cache. esz: element size in bytes (the caches have the key's dtype). */
int llmsvc_store_kv(const void *key, int64_t ks, const void *value, int64_t vs, void *k_cache,
                    void *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row_elems,
                    int64_t num_slots, int64_t esz) {
    for (int64_t t = 0; t < T; t++)
        if (slot_mapping[t] >= num_slots || slot_mapping[t] < -1) return -1;
    const size_t row = (size_t)(row_elems * esz);
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = slot_mapping[t];
        if (s < 0) continue;
        memcpy((char *)k_cache + s * row, (const char *)key + t * ks * esz, row);
        memcpy((char *)v_cache + s * row, (const char *)value + t * vs * esz, row);
    }
    return 0;
}
