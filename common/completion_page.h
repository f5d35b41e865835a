// The completion page: a memfd the daemon creates per session and both sides map. The daemon
// completes asynchronous requests by writing slot words; the client waits on them with plain
// loads (no system call once complete) and futex waits (while pending). Protocol:
// docs/completion.md.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tierd {

inline constexpr uint32_t kCompletionPageMagic = 0x54434d50;  // "TCMP"
inline constexpr uint32_t kCompletionPageVersion = 1;
inline constexpr uint32_t kCompletionSlots = 8192;
// Version bits a session's schedule may name (each picks one chunk of a pair; see the header).
inline constexpr uint32_t kVersionBits = 4096;

// Slot word: (sequence << 2) | state. Sequences run 1..2^30-1 per slot and then wrap to 1.
enum class SlotState : uint32_t {
  kIdle = 0,     // never used
  kPending = 1,  // the request is in flight
  kOk = 2,       // the request succeeded
  kFailed = 3,   // the request failed; `code` holds the absl/gRPC status code
};

inline constexpr uint32_t SlotWord(uint32_t sequence, SlotState state) {
  return (sequence << 2) | static_cast<uint32_t>(state);
}
inline constexpr uint32_t SlotSequence(uint32_t word) { return word >> 2; }
inline constexpr SlotState SlotStateOf(uint32_t word) { return static_cast<SlotState>(word & 3); }
inline constexpr uint32_t kMaxSlotSequence = (1u << 30) - 1;

// The value a slot's word reaches, in cyclic order, once request `sequence` has completed (ok or
// failed): (int32_t)(word - SlotDoneValue(sequence)) >= 0 from its completion on, including after
// the slot moves on to later requests (and after the sequence wraps). False while it is pending.
// GPU streams wait on this (cuStreamWaitValue32 with CU_STREAM_WAIT_VALUE_GEQ).
inline constexpr uint32_t SlotDoneValue(uint32_t sequence) {
  return SlotWord(sequence, SlotState::kOk);
}
inline constexpr bool SlotReached(uint32_t word, uint32_t value) {
  return static_cast<int32_t>(word - value) >= 0;
}

struct alignas(16) CompletionSlot {
  std::atomic<uint32_t> word;   // written by the daemon
  std::atomic<int32_t> code;    // written by the daemon before a kFailed word
  std::atomic<uint32_t> acked;  // written by the client: the sequence it has consumed
  uint32_t reserved;
};
static_assert(sizeof(CompletionSlot) == 16);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

struct alignas(4096) CompletionPageHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t slot_count;
  uint32_t reserved0;
  uint64_t session_id;
  // Reserved for the schedule cursor (the client advances it, the daemon reads it).
  std::atomic<uint64_t> cursor;
  // The version bits the client flips: an access of its schedule that names a pair of chunks is
  // to the first while its bit is clear, to the second while it is set (the two versions of one
  // thing: a step writes the other and flips the bit, and the schedule stays as declared). In
  // space that was reserved: zero for a client that names no pair. Only ever read as a hint.
  std::atomic<uint64_t> versions[kVersionBits / 64];
};
static_assert(sizeof(CompletionPageHeader) == 4096);

// The message of a failed request, kept in a small ring beside the slots: the daemon writes the
// record (sequence 0 while it writes), the client finds it by slot and sequence. A record can be
// overwritten by a later failure before it is read; the code in the slot is never lost.
inline constexpr uint32_t kErrorRecords = 64;
struct alignas(64) ErrorRecord {
  std::atomic<uint32_t> slot;
  std::atomic<uint32_t> sequence;  // 0 while being written
  char message[504];
};
static_assert(sizeof(ErrorRecord) == 512);

struct CompletionPage {
  CompletionPageHeader header;
  CompletionSlot slots[kCompletionSlots];
  ErrorRecord errors[kErrorRecords];
};
inline constexpr size_t kCompletionPageBytes = sizeof(CompletionPage);
static_assert(kCompletionPageBytes % 4096 == 0);

// A request's handle on its slot.
struct SlotToken {
  uint32_t slot = 0;
  uint32_t sequence = 0;
};

// Blocks on a shared-memory futex word while it equals `expected`, for at most `timeout`
// (absl::InfiniteDuration() to wait forever). Returns early on wake-ups and signals.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout);
// Wakes every waiter on a shared-memory futex word.
void FutexWakeAll(std::atomic<uint32_t>* word);

// Daemon side: records the message of a failed request (record `index` mod kErrorRecords).
void RecordError(CompletionPage& page, uint32_t index, SlotToken token, absl::string_view message);
// Client side: the message of a failed request, if its record is still there.
std::string FindError(const CompletionPage& page, SlotToken token);

// Client side: the state of a token without a system call. kPending while in flight; an error if
// the token does not name the slot's current request.
absl::StatusOr<SlotState> PollCompletion(const CompletionPage& page, SlotToken token);

// Client side: waits until the token's request completes or the deadline passes; returns the
// request's status and acknowledges the slot so the daemon may reuse it. No system call when the
// request has already completed.
absl::Status WaitCompletion(CompletionPage& page, SlotToken token, absl::Duration timeout);

}  // namespace tierd
