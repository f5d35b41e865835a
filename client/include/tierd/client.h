/* The tierd client library, C ABI.
 *
 * Opaque handles, plain C types, no exceptions: usable from C, and from Python through ctypes
 * without compiling anything against Python or PyTorch. Every function returns a tierd_status;
 * on failure tierd_last_error() gives the message, without the status's name (per thread, valid
 * until the thread's next call). Status values are the gRPC status codes. */
#ifndef TIERD_CLIENT_H_
#define TIERD_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TIERD_C_ABI_VERSION 14
/* 2: the optimizer (tierd_adam_*, tierd_cpu_adam_step)
 * 3: its state as a checkpoint (tierd_adam_get_state/set_state/set_steps), per-group
 *    hyperparameters (tierd_adam_set_group_hyper), open_mode; tierd_path_bytes
 * 5: tierd_adam_options.state_dtype (bf16 moments) and .speculative, tierd_adam_abandon_step
 * 6: groups of tensors with a step count each (tierd_adam_create_groups, _add_groups,
 *    _remove_groups, _group_count, _get/set_tensor_steps, _step_tensors); a viewed chunk's
 *    release and free handed to its last view (tierd_release_deferred, tierd_free_deferred)
 * 7: schedules naming pairs of chunks picked by version bits (tierd_set_paired_schedule,
 *    tierd_set_version)
 * 8: tierd_adam_wait_group (a group's gradients and out released before the step's end)
 * 10: groups stepped on the device (tierd_adam_set_group_place, _group_place, _lanes_get);
 *     tierd_allocate_transient
 * 11: tierd_adam_group.master (a group whose master weights are its out)
 * 12: tierd_import (the daemon reads byte ranges of a file into a chunk)
 * 13: tierd_adam_options.device_budget_bytes, tierd_adam_lanes.device_kept_bytes (state kept in
 *     the device tier between steps)
 * 14: tierd_discard (a chunk's copies dropped unwritten, its contents dead) */

typedef struct tierd_client tierd_client;
typedef uint64_t tierd_chunk_id;

typedef enum tierd_status {
  TIERD_OK = 0,
  TIERD_CANCELLED = 1,
  TIERD_UNKNOWN = 2,
  TIERD_INVALID_ARGUMENT = 3,
  TIERD_DEADLINE_EXCEEDED = 4,
  TIERD_NOT_FOUND = 5,
  TIERD_ALREADY_EXISTS = 6,
  TIERD_PERMISSION_DENIED = 7,
  TIERD_RESOURCE_EXHAUSTED = 8,
  TIERD_FAILED_PRECONDITION = 9,
  TIERD_ABORTED = 10,
  TIERD_OUT_OF_RANGE = 11,
  TIERD_UNIMPLEMENTED = 12,
  TIERD_INTERNAL = 13,
  TIERD_UNAVAILABLE = 14,
  TIERD_DATA_LOSS = 15,
  TIERD_UNAUTHENTICATED = 16,
  TIERD_PENDING = 100 /* tierd_poll: the request has not completed yet */
} tierd_status;

typedef enum tierd_tier {
  TIERD_TIER_HOST = 1,
  TIERD_TIER_NVME = 2,
  TIERD_TIER_DEVICE = 3
} tierd_tier;

typedef enum tierd_access {
  TIERD_ACCESS_READ = 1,
  TIERD_ACCESS_WRITE = 2,
  /* Every byte is written before any is read: the old contents are not fetched. */
  TIERD_ACCESS_OVERWRITE = 3
} tierd_access;

typedef struct tierd_completion {
  uint32_t slot;
  uint32_t sequence;
} tierd_completion;

typedef struct tierd_tier_usage {
  int32_t configured;
  uint64_t capacity_bytes;
  uint64_t used_bytes;
  uint64_t free_bytes;
  uint64_t largest_free_bytes;
} tierd_tier_usage;

/* What a session's acquisitions cost it and what the planner did for it (tierd_session_stats). */
typedef struct tierd_session_stats {
  uint64_t acquired_ready;  /* chunks in place when acquired */
  uint64_t acquired_waited; /* chunks that had to be brought in or waited for */
  uint64_t host_stall_ns;   /* time acquisitions waited, by tier */
  uint64_t device_stall_ns;
  uint64_t planner_fetches;
  uint64_t planner_drops;
  uint64_t planner_write_backs;
  uint64_t cursor;         /* steps started, as the daemon last saw */
  uint32_t schedule_steps; /* steps of the schedule in force, declared or traced */
  int32_t tracing;         /* 1 while a trace waits for or records its iteration */
} tierd_session_stats;

/* The ABI version this library implements (TIERD_C_ABI_VERSION when built). */
int tierd_abi_version(void);

/* The message of the calling thread's last failed call ("" if none). */
const char* tierd_last_error(void);

/* Opens a session. socket_dir may be NULL ($TIERD_SOCKET_DIR, else /run/tierd); client_name may
 * be NULL. */
tierd_status tierd_connect(const char* socket_dir, const char* client_name, tierd_client** out);
/* Ends the session: the daemon releases its pins and frees its scratch chunks (once the last
 * DLPack view of them is deleted, when some are alive). NULL is a no-op. */
void tierd_close(tierd_client* client);
uint64_t tierd_session_id(const tierd_client* client);

/* Allocates n scratch chunks of sizes[i] bytes in home_tier; ids go to out_ids[0..n). */
tierd_status tierd_allocate(tierd_client* client, size_t n, const uint64_t* sizes, int home_tier,
                            tierd_chunk_id* out_ids);
/* As tierd_allocate, the chunks transient: their contents are wanted briefly (a step's
 * gradients), so the daemon writes their copies down only when a tier needs the room. */
tierd_status tierd_allocate_transient(tierd_client* client, size_t n, const uint64_t* sizes,
                                      int home_tier, tierd_chunk_id* out_ids);
/* Allocates one named chunk; persistent chunks outlive the session. `open` is a set of flags:
 * TIERD_OPEN_EXISTING opens the user's persistent chunk of that name if there is one (else creates
 * it); with TIERD_OPEN_MUST_EXIST too, only opens (NOT_FOUND when there is none); TIERD_OPEN_SHARED
 * lets other sessions that also ask to share open it while this one holds it. 0 creates (and fails
 * with ALREADY_EXISTS when the name is taken). A session holds a lease on the persistent chunks
 * it creates or opens until it ends: others cannot open or free them (FAILED_PRECONDITION names
 * the holder). */
#define TIERD_OPEN_EXISTING 1
#define TIERD_OPEN_MUST_EXIST 2
#define TIERD_OPEN_SHARED 4
tierd_status tierd_allocate_named(tierd_client* client, const char* name, uint64_t size,
                                  int home_tier, int persistent, int open, tierd_chunk_id* out_id);
tierd_status tierd_free(tierd_client* client, size_t n, const tierd_chunk_id* ids);

/* Pins n chunks in tier. out_ptrs[i] receives chunk i's address in this process: a host address
 * (host tier, emulated device) or a CUDA device pointer on the daemon's GPU (device tier; see
 * tierd_cuda_device), NULL on NVMe; out_sizes[i] (may be NULL) its usable size; out_ready the
 * token to wait on (or tierd_stream_wait on) before use. */
tierd_status tierd_acquire(tierd_client* client, size_t n, const tierd_chunk_id* ids, int tier,
                           int access, void** out_ptrs, uint64_t* out_sizes,
                           tierd_completion* out_ready);
tierd_status tierd_release(tierd_client* client, size_t n, const tierd_chunk_id* ids);

/* ---- Zero-copy views (DLPack; include <dlpack/dlpack.h> to use the result) ---- */
struct DLManagedTensor;
#define TIERD_DLPACK_MAX_DIMS 16
/* A DLPack tensor viewing, without a copy, bytes of a chunk this handle holds acquired in tier
 * (TIERD_TIER_HOST, or TIERD_TIER_DEVICE: kDLCUDA memory on the daemon's GPU, kDLCPU with the
 * emulated device): offset bytes in, ndim dimensions of shape[] elements of DLPack type
 * (dl_code, dl_bits), e.g. (kDLFloat, 32), row-major. Wait for the acquisition's ready token
 * before reading. The view holds the acquisition: tierd_release of the chunk's last pin and
 * tierd_free fail with FAILED_PRECONDITION while it lives, and after tierd_close the session
 * stays open (its chunks and mappings in place) until the last view is deleted. Hand *out to a
 * consumer (torch.utils.dlpack.from_dlpack) or call (*out)->deleter(*out); any thread may.
 * tierd_release_deferred and tierd_free_deferred hand the release of a viewed chunk's last pin,
 * and its free, to its last view: done now where no view lives, else when the last view is
 * deleted (the chunk stays acquired, and its memory this session's, until then; a failure then
 * is not reported). What a scope's end does (Python's `with` blocks). */
tierd_status tierd_chunk_dlpack(tierd_client* client, tierd_chunk_id id, int tier, uint64_t offset,
                                int dl_code, int dl_bits, int ndim, const int64_t* shape,
                                struct DLManagedTensor** out);
tierd_status tierd_release_deferred(tierd_client* client, size_t n, const tierd_chunk_id* ids);
tierd_status tierd_free_deferred(tierd_client* client, size_t n, const tierd_chunk_id* ids);

/* Brings chunks into tier without pinning them; their reads are due priority milliseconds
 * before now (after, when negative), against this session's other I/O. */
tierd_status tierd_prefetch(tierd_client* client, size_t n, const tierd_chunk_id* ids, int tier,
                            int priority, tierd_completion* out);
/* Moves chunks down to tier (durably), dropping the copies above it unless keep_source. */
tierd_status tierd_evict(tierd_client* client, size_t n, const tierd_chunk_id* ids, int tier,
                         int keep_source, tierd_completion* out);
/* The chunks' contents are dead until this session next writes them: their copies are dropped
 * without being written (tierd::Client::Discard). */
tierd_status tierd_discard(tierd_client* client, size_t n, const tierd_chunk_id* ids);

/* TIERD_OK when the request completed successfully, TIERD_PENDING while in flight, otherwise the
 * request's error. Reads shared memory only. */
tierd_status tierd_poll(tierd_client* client, tierd_completion completion);
/* Waits up to timeout_ns (negative: forever), then acknowledges the token. */
tierd_status tierd_wait(tierd_client* client, tierd_completion completion, int64_t timeout_ns);

/* The daemon's GPU: its UUID (NUL-terminated, at most uuid_len bytes with the NUL), whether it is
 * the emulated device (host memory standing in for GPU memory: pointers acquired on the device tier
 * are then host pointers), and its memory. TIERD_NOT_FOUND when the node has no device tier. */
tierd_status tierd_device_info(tierd_client* client, char* uuid, size_t uuid_len, int* emulated,
                               uint64_t* memory_bytes);

/* The daemon's GPU as this process sees it: *ordinal receives its CUDA ordinal here (for
 * cudaSetDevice or torch.device("cuda", n)). Opens the GPU's primary context and, once, registers
 * this client's host segments with CUDA. TIERD_FAILED_PRECONDITION with the emulated device,
 * TIERD_NOT_FOUND without a device tier or when this process cannot see that GPU. */
tierd_status tierd_cuda_device(tierd_client* client, int* ordinal);
/* Enqueues on a CUDA stream (a cudaStream_t / CUstream as an integer, 0 for the legacy default
 * stream) a wait for the request's completion; work enqueued after it runs once the request is
 * done. Does not block. The wait also ends when the request fails: check tierd_poll/tierd_wait. */
tierd_status tierd_stream_wait(tierd_client* client, tierd_completion completion, uint64_t stream);

/* Schedules (docs/schedules.md). Declares the steps of one iteration, repeated: step i acquires
 * step_lengths[i] chunks, the next ones of ids[], each in tiers[] (host or device) for modes[]
 * (TIERD_ACCESS_*); the three arrays hold the accesses of all steps in order. Replaces the
 * session's schedule; n_steps == 0 clears it. Quotas: bytes of the host and device tiers the
 * planner may fill for this session (0: no limit but the tier's). */
tierd_status tierd_set_schedule(tierd_client* client, size_t n_steps, const size_t* step_lengths,
                                const tierd_chunk_id* ids, const int* tiers, const int* modes,
                                uint64_t host_quota_bytes, uint64_t device_quota_bytes);
/* As tierd_set_schedule, with pairs: where others[i] != 0, access i is to ids[i] while the
 * session's version bit version_bits[i] (< TIERD_VERSION_BITS) is clear and to others[i] while it
 * is set, so that two versions of one thing (a unit's weights before and after a step) stay one
 * schedule while tierd_set_version flips between them. others and version_bits: NULL, no pairs. */
#define TIERD_VERSION_BITS 4096
tierd_status tierd_set_paired_schedule(tierd_client* client, size_t n_steps,
                                       const size_t* step_lengths, const tierd_chunk_id* ids,
                                       const tierd_chunk_id* others, const uint32_t* version_bits,
                                       const int* tiers, const int* modes,
                                       uint64_t host_quota_bytes, uint64_t device_quota_bytes);
/* Sets version bit `bit` to `value` (0 or 1): a store into shared memory, no RPC. */
tierd_status tierd_set_version(tierd_client* client, uint32_t bit, int value);
/* Trace mode: records this session's acquisitions over the next iteration of steps_per_iteration
 * steps and uses them as the schedule from the iteration after on. */
tierd_status tierd_trace_schedule(tierd_client* client, uint32_t steps_per_iteration,
                                  uint64_t host_quota_bytes, uint64_t device_quota_bytes);
/* Step k (counting across iterations) has started: a store into shared memory, no RPC. */
tierd_status tierd_begin_step(tierd_client* client, uint64_t k);
tierd_status tierd_session_stats_get(tierd_client* client, tierd_session_stats* out);
/* This session's share of NVMe bandwidth while other sessions' I/O waits too: bytes in proportion
 * to its weight (default 1; at most the daemon's planner.max_session_weight). */
tierd_status tierd_set_bandwidth_weight(tierd_client* client, uint32_t weight);

/* ---- Shared bases (docs/streaming.md, "One copy per node") ---- */

/* What to make when the base does not exist: its chunks (size, home tier: host or NVMe), the
 * loader's descriptor of their contents, and a group (a gid the daemon's base_groups names) whose
 * members may open it too; or, job_writable, a base the ranks of this session's job write. */
typedef struct tierd_base_create {
  size_t n_chunks;
  const uint64_t* sizes;
  const int* homes;
  const void* descriptor;
  size_t descriptor_len;
  int share_with_group;
  uint32_t group;
  int job_writable;
} tierd_base_create;

/* A base as opened: its pointers stay valid until tierd_base_free(handle). */
typedef struct tierd_base_info {
  int created; /* this session made it: write the chunks, then tierd_base_seal */
  uint32_t creator_uid;
  size_t n_chunks;
  const tierd_chunk_id* ids;
  const uint64_t* sizes;
  const int* homes;
  const void* descriptor;
  size_t descriptor_len;
} tierd_base_info;

typedef struct tierd_base tierd_base;

/* Opens the base `name` (held until tierd_base_release or the session's end); with `create`
 * (NULL: open only) and no base of that name, makes it. ALREADY_EXISTS: it exists with other
 * chunks or descriptor; UNAVAILABLE: another session is loading it; PERMISSION_DENIED: it is not
 * shared with this user; NOT_FOUND: none, and no `create`. */
tierd_status tierd_base_open(tierd_client* client, const char* name,
                             const tierd_base_create* create, tierd_base** out,
                             tierd_base_info* info);
/* Frees the handle (and its info's arrays), not the hold. */
void tierd_base_free(tierd_base* base);
/* Seals the base this session loads: read-only from now on, with `descriptor` (when
 * descriptor_len > 0) replacing the one given to tierd_base_open. */
tierd_status tierd_base_seal(tierd_client* client, const char* name, const void* descriptor,
                             size_t descriptor_len);
tierd_status tierd_base_release(tierd_client* client, const char* name);
tierd_status tierd_base_pin(tierd_client* client, const char* name, int pinned);

/* One byte range of an import: file_offset .. file_offset + length of the file into the chunk
 * at chunk_offset. */
typedef struct tierd_file_range {
  uint64_t file_offset;
  uint64_t chunk_offset;
  uint64_t length;
} tierd_file_range;
/* Has the daemon read `n` byte ranges of the file `fd` (regular, open for reading) into chunk
 * `id`, which this session holds acquired for writing in the host tier; waits for it. file_size
 * and file_mtime_ns are what the caller saw (fstat) when it read the file's layout: a file that
 * is not that one (FAILED_PRECONDITION), changes while it is read (ABORTED) or ends early
 * (OUT_OF_RANGE) fails the import. `bytes` (may be NULL) receives the bytes read, `direct` (may
 * be NULL) whether the daemon read them with O_DIRECT. */
tierd_status tierd_import(tierd_client* client, tierd_chunk_id id, int fd, uint64_t file_size,
                          int64_t file_mtime_ns, size_t n, const tierd_file_range* ranges,
                          uint64_t* bytes, int* direct);

/* Usage of one tier. */
tierd_status tierd_tier_usage_get(tierd_client* client, int tier, tierd_tier_usage* out);
/* Number of chunks this session can see. */
tierd_status tierd_chunk_count(tierd_client* client, uint64_t* out);
/* Bytes the daemon has moved over a path since it started, all sessions together: path is
 * "host_to_nvme", "nvme_to_host", "host_to_device" or "device_to_host".
 * NOT_FOUND for a path the daemon does not have. */
tierd_status tierd_path_bytes(tierd_client* client, const char* path, uint64_t* bytes);

/* ---- Optimizer (tierd/optimizer.hpp has the full description) ---- */

typedef enum tierd_dtype { TIERD_FLOAT32 = 0, TIERD_BFLOAT16 = 1, TIERD_FLOAT16 = 2 } tierd_dtype;

/* In double, as the frameworks keep them (1 - beta2 from a float 0.999 is 1.3e-5 off). */
typedef struct tierd_adam_hyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int32_t adamw; /* 1: decoupled weight decay (AdamW); 0: L2 added to the gradient (Adam) */
} tierd_adam_hyper;

/* One Adam step (step counts from 1) in place over n parameters in this process's memory: fp32
 * param, m and v; grad of grad_dtype, divided by grad_scale; out (may be NULL) receives the new
 * weights as out_dtype (TIERD_BFLOAT16 or TIERD_FLOAT16). Vectorized for the running CPU, on a
 * process-wide pool of `threads` pinned threads (0: one per CPU this process may use). */
tierd_status tierd_cpu_adam_step(float* param, float* m, float* v, const void* grad, int grad_dtype,
                                 void* out, int out_dtype, uint64_t n,
                                 const tierd_adam_hyper* hyper, float grad_scale, int64_t step,
                                 int threads);

typedef struct tierd_adam tierd_adam;

typedef struct tierd_adam_options {
  const char* socket_dir; /* NULL: $TIERD_SOCKET_DIR, else /run/tierd */
  const char* name;       /* names the state chunks ("<name>/<group>/<shard>") */
  int32_t home_tier;      /* TIERD_TIER_NVME or TIERD_TIER_HOST */
  int32_t persistent;     /* the state outlives the process; reopened by name */
  int32_t reset;          /* discard persistent state of this name */
  int32_t threads;        /* kernel threads, 0: one per CPU */
  int32_t check_finite;   /* skip (and report) groups with infinite or NaN gradients */
  uint64_t host_budget_bytes;
  uint64_t shard_params; /* parameters per state chunk, 0: chosen from the budget */
  tierd_adam_hyper hyper;
  int32_t open_mode;   /* persistent state: TIERD_ADAM_CREATE_OR_OPEN, _CREATE or _OPEN */
  int32_t state_dtype; /* m and v: TIERD_FLOAT32, or TIERD_BFLOAT16 (rounded stochastically) */
  int32_t speculative; /* two versions of the state: a step can be abandoned */
  /* scratch state the device lane keeps in the device tier between steps (0: none) */
  uint64_t device_budget_bytes;
} tierd_adam_options;
#define TIERD_ADAM_CREATE_OR_OPEN 0
#define TIERD_ADAM_CREATE 1 /* ALREADY_EXISTS when state of this name exists */
#define TIERD_ADAM_OPEN 2   /* NOT_FOUND when none does (resuming) */

typedef struct tierd_adam_step_stats {
  int64_t step; /* the step just taken, counting from 1 across resumptions */
  uint64_t wall_ns;
  uint64_t compute_ns;
  uint64_t state_wait_ns; /* waiting for state to arrive in the host tier */
  uint64_t write_wait_ns; /* waiting for write-backs */
  uint64_t state_bytes;
  uint32_t skipped_groups; /* groups left as they were: their gradients were not finite */
} tierd_adam_step_stats;

/* The defaults (those of tierd::OffloadedAdamOptions). */
void tierd_adam_options_init(tierd_adam_options* options);
/* Opens the optimizer's own session and its state: n_groups groups named group_names[i] of
 * group_params[i] parameters. See tierd::OffloadedAdam::Create for the errors. */
tierd_status tierd_adam_create(size_t n_groups, const char* const* group_names,
                               const uint64_t* group_params, const tierd_adam_options* options,
                               tierd_adam** out);
/* A group of tensors laid end to end, each with its own step count (torch's per-parameter "step"):
 * n_tensors sizes summing to params (zeros allowed); n_tensors 0: one tensor of params. master:
 * TIERD_ADAM_MASTER_IN_STATE, or TIERD_ADAM_MASTER_IN_OUT (tierd::ParamGroup::Master::kOut: the
 * state holds m and v only; each step's out is fp32 and holds the weights on entry; scratch state
 * only; set_state takes no params, get_state none). */
#define TIERD_ADAM_MASTER_IN_STATE 0
#define TIERD_ADAM_MASTER_IN_OUT 1
typedef struct tierd_adam_group {
  const char* name;
  uint64_t params;
  size_t n_tensors;
  const uint64_t* tensor_params;
  int32_t master;
} tierd_adam_group;
/* tierd_adam_create with groups of tensors. */
tierd_status tierd_adam_create_groups(size_t n_groups, const tierd_adam_group* groups,
                                      const tierd_adam_options* options, tierd_adam** out);
/* Groups added after the others (without weights until set_params), or removed (their state
 * freed; the others keep their order, which is their index). Not during a step. */
tierd_status tierd_adam_add_groups(tierd_adam* adam, size_t n_groups,
                                   const tierd_adam_group* groups);
tierd_status tierd_adam_remove_groups(tierd_adam* adam, size_t n, const size_t* groups);
size_t tierd_adam_group_count(const tierd_adam* adam);
/* Each tensor's count of steps (n: the group's tensors). Setting them loads a checkpoint. */
tierd_status tierd_adam_get_tensor_steps(tierd_adam* adam, size_t group, int64_t* out, size_t n);
tierd_status tierd_adam_set_tensor_steps(tierd_adam* adam, size_t group, const int64_t* steps,
                                         size_t n);
void tierd_adam_destroy(tierd_adam* adam);
int tierd_adam_resumed(const tierd_adam* adam);
int64_t tierd_adam_steps_taken(const tierd_adam* adam);
int tierd_adam_initialized(const tierd_adam* adam, size_t group);
uint64_t tierd_adam_state_bytes(const tierd_adam* adam);
/* A group's fp32 master weights (n must be its parameter count); set_params zeroes m and v. */
tierd_status tierd_adam_set_params(tierd_adam* adam, size_t group, const float* values, uint64_t n);
tierd_status tierd_adam_get_params(tierd_adam* adam, size_t group, float* out, uint64_t n);
/* Parts of a group's state. */
#define TIERD_ADAM_PARAMS 0
#define TIERD_ADAM_M 1
#define TIERD_ADAM_V 2
/* Reads one part (n must be the group's parameter count), in fp32 whatever the state dtype. */
tierd_status tierd_adam_get_state(tierd_adam* adam, size_t group, int part, float* out, uint64_t n);
/* Sets a group's weights, m and v at once (m or v NULL: zero; params NULL for a group whose master
 * is its out); loading a checkpoint. */
tierd_status tierd_adam_set_state(tierd_adam* adam, size_t group, const float* params,
                                  const float* m, const float* v, uint64_t n);
/* The count of steps taken, and every tensor's (the next step's bias correction uses steps + 1);
 * tierd_adam_set_tensor_steps sets tensors' own counts after it. */
tierd_status tierd_adam_set_steps(tierd_adam* adam, int64_t steps);
/* From the next step on: every group's learning rate. */
tierd_status tierd_adam_set_lr(tierd_adam* adam, double lr);
/* From the next step on: one group's hyperparameters. */
tierd_status tierd_adam_set_group_hyper(tierd_adam* adam, size_t group,
                                        const tierd_adam_hyper* hyper);
tierd_status tierd_adam_begin_step(tierd_adam* adam, float grad_scale);
/* Queues a group's step and returns; grad and out (may be NULL) must stay valid until
 * tierd_adam_finish_step returns. */
tierd_status tierd_adam_step_group(tierd_adam* adam, size_t group, const void* grad, int grad_dtype,
                                   void* out, int out_dtype);
/* tierd_adam_step_group tensor by tensor: flags[i] (n_flags: the group's tensors) of
 * TIERD_ADAM_TENSOR_STEP (it has a gradient: stepped, its step count grows; without it the tensor
 * is left exactly as it is) and TIERD_ADAM_TENSOR_TAKE_WEIGHTS (its master weights first become
 * weights[...], fp32 values laid out as the gradients). grad may be NULL when nothing is stepped,
 * weights when nothing is taken. */
#define TIERD_ADAM_TENSOR_STEP 1
#define TIERD_ADAM_TENSOR_TAKE_WEIGHTS 2
tierd_status tierd_adam_step_tensors(tierd_adam* adam, size_t group, const void* grad,
                                     int grad_dtype, void* out, int out_dtype, const uint8_t* flags,
                                     size_t n_flags, const float* weights);
/* Waits until group `group`'s queued step no longer reads its grad nor writes its out (they may be
 * released from then on; the state's write-back may still run), at most timeout_ms:
 * TIERD_DEADLINE_EXCEEDED when it is not, TIERD_FAILED_PRECONDITION when the group was not queued
 * this step. Unlike the other calls of a step, any thread may make it while another drives the
 * step. */
tierd_status tierd_adam_wait_group(tierd_adam* adam, size_t group, int64_t timeout_ms);
tierd_status tierd_adam_finish_step(tierd_adam* adam, tierd_adam_step_stats* out);
/* Where a group is stepped from the next step on (tierd::StepPlace): on the host by the CPU
 * kernels, or on the device, its state brought up into the daemon's device tier each step and sent
 * home again. A device group's grad and out are memory the device reaches: device memory, or
 * pinned host memory it reads and writes in place over the link (any host memory on an emulated
 * device); its weights are host memory. FAILED_PRECONDITION without the daemon's device tier, with
 * bf16 moments, or on a GPU with a library built without CUDA; not during a step. */
#define TIERD_ADAM_ON_HOST 0
#define TIERD_ADAM_ON_DEVICE 1
tierd_status tierd_adam_set_group_place(tierd_adam* adam, size_t group, int place);
int tierd_adam_group_place(const tierd_adam* adam, size_t group);
/* The last finished step's two lanes: parameters each stepped and the time each was busy with
 * them; share: the device share that would balance them, from the rates of the last steps (-1
 * until both lanes have stepped); device_kept_bytes: the device lane's state the step left in
 * the device tier (tierd_adam_options.device_budget_bytes). */
typedef struct tierd_adam_lanes {
  uint64_t host_params;
  uint64_t host_ns;
  uint64_t device_params;
  uint64_t device_ns;
  double share;
  uint64_t device_kept_bytes;
} tierd_adam_lanes;
tierd_status tierd_adam_lanes_get(const tierd_adam* adam, tierd_adam_lanes* out);
/* Speculative optimizers: discards the step begun, leaving the state as it was at begin_step. */
tierd_status tierd_adam_abandon_step(tierd_adam* adam);

#ifdef __cplusplus
}
#endif

#endif /* TIERD_CLIENT_H_ */
