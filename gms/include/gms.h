/*
 * gms.h: libgms, the engine side of the GPU Memory Service (GMS) as a C ABI.
 *
 * An engine connects to the gmsd of its GPU (socket gms-<GPU-UUID>.sock in
 * GMS_SOCKET_DIR), holds a lease for as long as it is connected, and either
 * loads + commits the weights (rw) or maps the committed weights read-only at
 * the writer's addresses (ro). Protocol: docs/gms-protocol.md; CUDA notes:
 * docs/gms-cuda.md.
 *
 * Threading: the client is process-wide (PyTorch's allocator callbacks carry
 * no user pointer). Every call takes one internal lock, so calls from any
 * thread are safe and serialised. The CUDA primary context of the connected
 * device is retained and made current on the calling thread by each call.
 *
 * Errors: a call that fails returns NULL or a negative number and records a
 * reason, read with gms_last_error() on the same thread. No call aborts or
 * unwinds into the caller.
 *
 * Ownership: libgms owns every mapping, descriptor and reservation; callers
 * get device addresses only, valid until gms_disconnect() (or, for KV, until
 * gms_kv_release()). Strings returned through `char *` / `char **` are the
 * caller's and are freed with gms_string_free().
 */
#ifndef GMS_H
#define GMS_H

#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

/* gms_connect's `device` for the host backend. */
#define GMS_DEVICE_HOST (-1)

/* Lease modes for gms_connect. */
#define GMS_MODE_RW 0
#define GMS_MODE_RO 1
#define GMS_MODE_RW_OR_RO 2

/* Leases returned by gms_connect / gms_lease. */
#define GMS_LEASE_RW 0
#define GMS_LEASE_RO 1

/* The reason for this thread's last failure ("" if none). The pointer stays
 * valid until the next libgms call on this thread; do not free it. */
const char *gms_last_error(void);

/* Connects to the daemon of CUDA device `device` (an ordinal), or, with a
 * negative `device` (GMS_DEVICE_HOST), to the host backend's daemon: memfds
 * mapped into this process, for CPU engines; the calls below then work the
 * same on host addresses (granularity: the daemon's, a page; allocations
 * placed from $GMS_HOST_VA_BASE, default 0x3f0000000000, so that readers
 * find the writer's addresses free). socket_path: NULL means
 * $GMS_SOCKET_DIR/gms-<GPU-UUID>.sock, or gms-host.sock (default dir
 * /run/shadow/gms). mode: GMS_MODE_*. client: a name for `gmsd status`, or
 * NULL. While the daemon is absent or another engine holds the write lease,
 * retries for up to timeout_ms. Returns the lease granted (GMS_LEASE_*) or
 * -1. One connection per process. */
int gms_connect(const char *socket_path, int mode, const char *client,
                int device, int timeout_ms);

/* GMS_LEASE_RW, GMS_LEASE_RO, or -1 when not connected. A writer becomes a
 * reader at commit. */
int gms_lease(void);

/* Allocation granularity of the device in bytes (2 MiB on an H200); 0 when
 * not connected. */
uint64_t gms_granularity(void);

/* Writer: a new GMS allocation of at least `size` bytes (rounded up to the
 * granularity), mapped read-write at a fresh address. tag: NULL means
 * "weights". Returns the device address or NULL. */
void *gms_allocate(uint64_t size, const char *tag);

/* Writer: frees an allocation from gms_allocate / gms_torch_malloc. Returns
 * 0 (freed), 1 (no-op: the layout is committed and shared), or -1. */
int gms_free(void *ptr);

/* torch.cuda.memory.CUDAPluggableAllocator(path, "gms_torch_malloc",
 * "gms_torch_free"): one GMS allocation ("weights") per call; NULL on
 * failure, which torch reports as out-of-memory. `stream` is a
 * cudaStream_t; mapping is synchronous, so it is not used. */
void *gms_torch_malloc(ssize_t size, int device, void *stream);
void gms_torch_free(void *ptr, ssize_t size, int device, void *stream);

/* Writer: stores key -> value (e.g. a tensor's allocation id, offset, shape,
 * stride and dtype as JSON). 0 or -1. */
int gms_put_meta(const char *key, const char *value);

/* Reads a metadata value: 1 and *out set (free with gms_string_free), 0 if
 * absent, -1 on error. */
int gms_get_meta(const char *key, char **out);

/* Writer: waits for the device, then freezes the layout: every allocation is
 * remapped read-only at the same address and the lease becomes ro. Returns
 * the layout generation (> 0) or -1. */
int64_t gms_commit(void);

/* Reader: maps every committed allocation read-only at the address the
 * writer used. Fails (-1) if any of those addresses is taken in this
 * process. Returns the number of allocations mapped. */
int gms_import(void);

/* The layout this lease sees as JSON: {"generation":N,"allocations":[{"id",
 * "tag","size","va"}...],"metadata":{key:value}}. Free with
 * gms_string_free. NULL on error. */
char *gms_layout_json(void);

/* Frees a string returned by libgms; NULL is ignored. */
void gms_string_free(char *s);

/* KV cache: reserve `bytes` of addresses (rounded up), backed by nothing;
 * returns a handle >= 0 and the address in *addr, or -1. Its memory is
 * fresh, NOT zeroed device pages, in chunks (2 GiB), always a prefix
 * [addr, addr + backed) of the range.
 *
 * gms_kv_materialise backs all of it before it returns, waiting up to
 * GMS_KV_OOM_WAIT_MS (default 5000) while the device is out of memory (a
 * dead engine's memory is freed by the driver while it tears that process
 * down); 0 or -1, and on -1 nothing stays backed.
 *
 * gms_kv_wake is the promoted engine's wake: it returns once `min_bytes`
 * are backed (0: at once; waiting up to GMS_KV_OOM_WAIT_MS for them) and a
 * thread of libgms backs the rest as memory allows, giving up after
 * GMS_KV_OOM_WAIT_MS without any memory coming back (the cache stays
 * partly backed, "stalled"). Returns the bytes backed, or -1.
 * gms_kv_backed: bytes backed now (-1 on error). gms_kv_wait: waits,
 * without blocking other libgms calls, until `bytes` are backed, the cache
 * stops growing or `timeout_ms` pass; returns the bytes backed then.
 * gms_kv_event_fd: an eventfd readable after each change (read 8 bytes to
 * reset it; owned by libgms, do not close). gms_kv_info_json: bytes,
 * chunk, backed, growth ("reserved", "growing", "backed", "stalled",
 * "failed"), full_after_ms, waited_ms / error; free with gms_string_free.
 *
 * gms_kv_release stops the growth, gives the pages back and keeps the
 * addresses; 0 or -1. */
int64_t gms_kv_reserve(uint64_t bytes, uint64_t *addr);
int gms_kv_materialise(int64_t kv);
int64_t gms_kv_wake(int64_t kv, uint64_t min_bytes);
int64_t gms_kv_backed(int64_t kv);
int64_t gms_kv_wait(int64_t kv, uint64_t bytes, uint64_t timeout_ms);
int gms_kv_event_fd(int64_t kv);
char *gms_kv_info_json(int64_t kv);
int gms_kv_release(int64_t kv);

/* The pair's KV pool: device memory gmsd owns, which outlives every engine
 * and which the holder of the pair's election lock alone may write.
 * gms_kv_pool_open takes its write lease (a connection of its own),
 * showing proof_fd, a descriptor through which this engine holds the
 * election lock, and maps the pool read-write at the address every engine
 * of the pair maps it at. `bytes` and `index_bytes` size a pool made now
 * (created = 1: nothing is in it); an existing one comes as it is, with
 * what the engine before this one left in it and in its index (host
 * memory: pread/pwrite index_fd). fence_fd becomes readable once every
 * engine that wrote the pool before is gone: until then write only where
 * none of them could have been writing (docs/engine-contract.md,
 * "Carrying the KV cache"). Both descriptors are libgms's: close neither.
 * One per process; 0 or -1. gms_kv_pool_close gives the lease back (the
 * pool stays gmsd's); 0 or -1. */
typedef struct {
    uint64_t addr;
    uint64_t size;
    uint64_t pool;
    uint64_t index_bytes;
    int created;
    int index_fd;
    int fence_fd;
} gms_kv_pool;
int gms_kv_pool_open(int proof_fd, uint64_t bytes, uint64_t index_bytes, gms_kv_pool *out);
int gms_kv_pool_close(void);

/* gms_kv_pool_open, mapping before it returns only the pool's allocations
 * that hold its first `first_bytes` (the first one at least): a thread of
 * libgms maps the others, in order. Until they are all mapped, use only
 * the first gms_kv_pool_mapped() bytes. gms_kv_pool_mapped: bytes mapped
 * from the pool's start (its size once all are); -1 without a pool, or
 * once mapping the rest failed (what is mapped stays usable).
 * gms_kv_pool_wait_mapped waits, up to timeout_ms, for `bytes` of it;
 * returns the bytes mapped then, or -1. */
int gms_kv_pool_open_first(int proof_fd, uint64_t bytes, uint64_t index_bytes, uint64_t first_bytes,
                           gms_kv_pool *out);
int64_t gms_kv_pool_mapped(void);
/* Bytes of the KV pool mapped before the grant returned; -1 without a pool. */
int64_t gms_kv_pool_mapped_at_grant(void);
int64_t gms_kv_pool_wait_mapped(uint64_t bytes, uint64_t timeout_ms);

/* Where the KV pool's grant spent its time, in microseconds: gmsd's
 * answer (request sent -> answer read) and the mapping (import, map,
 * access). 0, or -1 without a pool. */
int gms_kv_pool_grant_us(uint64_t *answer_us, uint64_t *map_us);

/* Reserves addresses for the KV pool before this process holds its lease
 * (a parked engine): the existing pool's (returns 1), or `bytes` wherever
 * the device puts them (returns 0: no pool yet, where this process makes
 * it if it is the first granted; or the pool's address was taken here).
 * Nothing is mapped until gms_kv_pool_open, which takes these addresses:
 * work captured over them now (a CUDA graph) runs on the pool once it is
 * granted at the same address. A later call moves the reservation to the
 * pool's address once a pool exists and keeps it where it is otherwise.
 * *out_addr gets the address; -1 on error. */
int gms_kv_pool_reserve(uint64_t bytes, uint64_t *out_addr);

/* sleep != 0: unmaps every weight mapping of this process, keeping the
 * addresses; sleep == 0: maps them again. 0 or -1. */
int gms_weights_sleep(int sleep);

/* Ends the lease: unmaps everything and closes the connection. A writer that
 * has not committed has its allocations discarded by gmsd. */
void gms_disconnect(void);

#ifdef __cplusplus
}
#endif

#endif /* GMS_H */
