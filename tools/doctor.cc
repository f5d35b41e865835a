// The probes behind `tierctl doctor`. Each one tries the real thing (an io_uring, an O_DIRECT read,
// a CUDA host registration, an export of device memory to another process) on a small scale,
// undoes it, and says what it found. Nothing is left behind: temporary files are removed and GPU
// memory freed. The cross-process probes re-run this program as a child (`--probe=NAME`), since
// CUDA cannot be used across fork().
#include "tools/doctor.h"

#include <fcntl.h>
#include <liburing.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/cuda_driver.h"
#include "common/sizes.h"
#include "common/wire.h"
#include "tierd/client.hpp"

extern char** environ;

namespace tierd::doctor {
namespace {

Check Make(std::string name, Result result, std::string detail, std::string fix = "") {
  return Check{std::move(name), result, std::move(detail), std::move(fix)};
}

std::string Errno(int e) { return absl::StrCat(strerror(e), " (errno ", e, ")"); }

Check IoUring() {
  io_uring ring;
  const int r = io_uring_queue_init(4, &ring, 0);
  if (r == 0) {
    io_uring_queue_exit(&ring);
    utsname u{};
    uname(&u);
    return Make("io_uring", Result::kOk, absl::StrCat("available (Linux ", u.release, ")"));
  }
  const std::string fallback =
      "the daemon falls back to its thread-pool pread/pwrite backend (more CPU per byte); ";
  if (r == -EPERM) {
    return Make("io_uring", Result::kWarn,
                "io_uring_setup refused (EPERM): blocked by a seccomp profile or "
                "kernel.io_uring_disabled",
                fallback +
                    "allow io_uring_setup, io_uring_enter and io_uring_register in the "
                    "container's seccomp profile, or set sysctl kernel.io_uring_disabled=0");
  }
  if (r == -ENOSYS) {
    return Make("io_uring", Result::kWarn, "this kernel has no io_uring",
                fallback + "use Linux 5.10 or newer");
  }
  return Make("io_uring", Result::kWarn, "io_uring_queue_init failed: " + Errno(-r), fallback);
}

std::string FileSystem(const std::string& path) {
  struct statfs s {};
  if (statfs(path.c_str(), &s) != 0) return "unknown file system";
  switch (static_cast<uint64_t>(s.f_type)) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x9123683E:
      return "btrfs";
    case 0x01021994:
      return "tmpfs";
    case 0x794c7630:
      return "overlayfs";
    case 0x6969:
      return "nfs";
    case 0x65735546:
      return "fuse";
    default:
      return absl::StrFormat("file system 0x%x", static_cast<uint64_t>(s.f_type));
  }
}

// An O_DIRECT read of an existing region (nothing written), or an O_DIRECT write of a temporary
// file beside where a new region would go.
Check ODirectAt(const std::string& path);

Check ODirect(const std::string& path) {
  Check c = ODirectAt(path);
  c.detail = path + ": " + c.detail;
  return c;
}

Check ODirectAt(const std::string& path) {
  const std::string name = "o_direct";
  constexpr size_t kBlock = 4096;
  void* raw = nullptr;
  if (posix_memalign(&raw, kBlock, kBlock) != 0) return Make(name, Result::kFail, "out of memory");
  std::unique_ptr<void, decltype(&free)> buffer(raw, &free);
  std::memset(raw, 0, kBlock);
  const std::string no_direct_fix =
      "put NVMe regions on a local ext4 or xfs file system (or a raw block device); tmpfs, "
      "overlayfs and most network file systems refuse O_DIRECT";
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) {
    const int fd = open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
      const int e = errno;
      return Make(name, Result::kFail, "cannot open it with O_DIRECT: " + Errno(e),
                  e == EINVAL ? no_direct_fix : "check the path and its permissions");
    }
    const ssize_t n = pread(fd, raw, kBlock, 0);
    const int e = errno;
    close(fd);
    if (n < 0) {
      return Make(name, Result::kFail, "an O_DIRECT read failed: " + Errno(e), no_direct_fix);
    }
    return Make(name, Result::kOk,
                absl::StrCat("O_DIRECT reads work (", FileSystem(path), ", existing region)"));
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Make(name, Result::kFail, "neither the region nor its directory exists",
                "create " + dir + " (the daemon creates the region file itself)");
  }
  const std::string probe = absl::StrCat(dir, "/.tierd-doctor-", getpid());
  const int fd = open(probe.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int e = errno;
    return Make(name, Result::kFail, "cannot create a file with O_DIRECT there: " + Errno(e),
                e == EINVAL ? no_direct_fix : "check the directory's permissions");
  }
  const ssize_t n = pwrite(fd, raw, kBlock, 0);
  const int e = errno;
  close(fd);
  unlink(probe.c_str());
  if (n != static_cast<ssize_t>(kBlock)) {
    return Make(name, Result::kFail, "an O_DIRECT write failed: " + Errno(e), no_direct_fix);
  }
  return Make(name, Result::kOk,
              absl::StrCat("O_DIRECT writes work (", FileSystem(dir), "; region not created yet)"));
}

Check Memlock(uint64_t host_capacity) {
  rlimit r{};
  getrlimit(RLIMIT_MEMLOCK, &r);
  const std::string where =
      " (this process's limit; the systemd unit sets LimitMEMLOCK=infinity for the daemon)";
  if (r.rlim_cur == RLIM_INFINITY) return Make("memlock", Result::kOk, "unlimited" + where);
  const std::string limit = FormatSize(r.rlim_cur);
  if (host_capacity == 0) {
    return Make("memlock", Result::kWarn, limit + where + "; host.capacity unknown",
                "start the daemon (or pass --host_capacity) to compare");
  }
  if (r.rlim_cur >= host_capacity) {
    return Make("memlock", Result::kOk,
                absl::StrCat(limit, ", enough for host.capacity ", FormatSize(host_capacity)));
  }
  return Make("memlock", Result::kFail,
              absl::StrCat(limit, " cannot pin host.capacity ", FormatSize(host_capacity), where),
              "raise it: LimitMEMLOCK=infinity in the unit, `ulimit -l unlimited`, or "
              "--ulimit memlock=-1 for a container (or lower host.capacity)");
}

uint64_t MeminfoValue(const std::string& text, const std::string& key) {
  const size_t at = text.find(key + ":");
  if (at == std::string::npos) return 0;
  uint64_t v = 0;
  std::istringstream(text.substr(at + key.size() + 1)) >> v;
  return v;
}

Check HugePages(uint64_t host_capacity) {
  std::ifstream in("/proc/meminfo");
  std::stringstream text;
  text << in.rdbuf();
  const uint64_t free_pages = MeminfoValue(text.str(), "HugePages_Free");
  const uint64_t total = MeminfoValue(text.str(), "HugePages_Total");
  const uint64_t page = MeminfoValue(text.str(), "Hugepagesize") * 1024;
  std::string thp = "unknown";
  std::ifstream t("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string line;
  if (std::getline(t, line)) {
    const size_t a = line.find('['), b = line.find(']');
    if (a != std::string::npos && b > a) thp = line.substr(a + 1, b - a - 1);
  }
  const std::string detail = absl::StrCat(free_pages, " of ", total, " huge pages of ",
                                          FormatSize(page), " free; shmem THP ", thp);
  if (page == 0) return Make("huge_pages", Result::kWarn, "no huge page support", "");
  const uint64_t needed = host_capacity == 0 ? 0 : (host_capacity + page - 1) / page;
  if (host_capacity != 0 && free_pages >= needed) {
    return Make("huge_pages", Result::kOk,
                absl::StrCat(detail, ": enough for host.capacity ", FormatSize(host_capacity)));
  }
  return Make("huge_pages", Result::kWarn,
              absl::StrCat(detail, host_capacity != 0 ? "; the host tier uses 4 KiB pages" : ""),
              absl::StrCat("reserve them for faster pinning and fewer TLB misses: sysctl "
                           "vm.nr_hugepages=",
                           needed == 0 ? std::string("N") : absl::StrCat(needed),
                           " (or hugepages= on the kernel command line)"));
}

Check Sockets(const std::string& dir) {
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) {
    return Make("sockets", Result::kWarn, dir + " does not exist: no daemon has started here",
                "start the daemon (systemctl start tierd); it creates the directory");
  }
  if ((st.st_mode & S_IWOTH) != 0 || ((st.st_mode & S_IWGRP) != 0 && (st.st_mode & S_ISVTX) == 0)) {
    return Make(
        "sockets", Result::kFail,
        absl::StrFormat("%s is mode %04o: others can replace the sockets", dir, st.st_mode & 07777),
        "chmod 0750 " + dir + " (the daemon refuses to start on it as it is)");
  }
  std::string found;
  for (const char* name : {kRpcSocketName, kSessionSocketName}) {
    struct stat s {};
    const std::string path = dir + "/" + name;
    if (stat(path.c_str(), &s) != 0 || !S_ISSOCK(s.st_mode)) {
      return Make("sockets", Result::kWarn, path + " is missing: the daemon is not running",
                  "start the daemon (systemctl start tierd)");
    }
    if ((s.st_mode & S_IWOTH) != 0) {
      return Make(
          "sockets", Result::kFail,
          absl::StrFormat("%s is mode %04o: every user can connect", path, s.st_mode & 07777),
          "restart the daemon; set socket_group to share it with a group");
    }
    absl::StrAppend(&found, found.empty() ? "" : ", ", name,
                    absl::StrFormat(" %04o gid %d", s.st_mode & 07777, s.st_gid));
  }
  return Make("sockets", Result::kOk,
              absl::StrFormat("%s mode %04o: %s", dir, st.st_mode & 07777, found));
}

#ifdef TIERD_HAVE_CUDA

// Runs this program as `doctor --probe=NAME ARG` with `fd` as its descriptor 3; returns its exit
// status and its one line of output.
int RunChild(const std::string& self, const std::string& probe, const std::string& argument, int fd,
             std::string* output) {
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) {
    *output = "pipe: " + Errno(errno);
    return -1;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  if (fd >= 0) posix_spawn_file_actions_adddup2(&actions, fd, 3);
  const std::string p = "--probe=" + probe;
  const std::string a = "--arg=" + argument;
  char* argv[] = {const_cast<char*>(self.c_str()), const_cast<char*>("doctor"),
                  const_cast<char*>(p.c_str()), const_cast<char*>(a.c_str()), nullptr};
  pid_t pid = -1;
  const int e = posix_spawn(&pid, self.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  if (e != 0) {
    close(out[0]);
    *output = "spawning " + self + ": " + Errno(e);
    return -1;
  }
  // Read what it says, then reap it; a child stuck in the driver is killed after 30 s.
  fcntl(out[0], F_SETFL, O_NONBLOCK);
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  int status = 0;
  bool reaped = false;
  char buf[512];
  while (!reaped) {
    ssize_t n;
    while ((n = read(out[0], buf, sizeof(buf))) > 0) output->append(buf, n);
    if (waitpid(pid, &status, WNOHANG) == pid) {
      reaped = true;
    } else if (absl::Now() > give_up) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      *output += " (killed after 30 s)";
      reaped = true;
    } else {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  ssize_t n;
  while ((n = read(out[0], buf, sizeof(buf))) > 0) output->append(buf, n);
  close(out[0]);
  while (!output->empty() && output->back() == '\n') output->pop_back();
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

constexpr uint32_t kPattern = 0x7D1E5EEDu;

// The primary context of device 0, current on this thread while it lives.
class Context {
 public:
  explicit Context(const CudaDriver* d) : d_(d) {
    ok_ = d->Check(d->cuDeviceGet(&dev_, 0), "cuDeviceGet");
    if (ok_.ok())
      ok_ = d->Check(d->cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    if (ok_.ok()) ok_ = d->Check(d->cuCtxSetCurrent(ctx_), "cuCtxSetCurrent");
  }
  ~Context() {
    if (ctx_ != nullptr) d_->cuDevicePrimaryCtxRelease(dev_);
  }
  const absl::Status& status() const { return ok_; }
  CUdevice device() const { return dev_; }

 private:
  const CudaDriver* d_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  absl::Status ok_;
};

// Shared memory as clients and the daemon share it: a memfd, mapped shared.
struct SharedPage {
  explicit SharedPage(size_t bytes) : size(bytes) {
    fd = memfd_create("tierd-doctor", MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) == 0) {
      void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      base = p == MAP_FAILED ? nullptr : p;
    }
  }
  ~SharedPage() {
    if (base != nullptr) munmap(base, size);
    if (fd >= 0) close(fd);
  }
  size_t size;
  int fd = -1;
  void* base = nullptr;
};

std::vector<Check> CudaChecks(const std::string& self) {
  std::vector<Check> checks;
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  const char* const kNames[] = {"cuda.devices", "cuda.host_register", "cuda.vmm_fd_ipc",
                                "cuda.legacy_ipc", "cuda.stream_wait"};
  if (!driver.ok()) {
    checks.push_back(Make("cuda.driver", Result::kSkip,
                          absl::StrCat("no GPU here: ", driver.status().message()),
                          "none needed without a GPU: the daemon serves the host and NVMe tiers "
                          "(device.backend = emulated stands in for a GPU in tests)"));
    for (const char* n : kNames) checks.push_back(Make(n, Result::kSkip, "no CUDA driver"));
    return checks;
  }
  const CudaDriver* d = *driver;
  int version = 0, count = 0;
  d->cuDriverGetVersion(&version);
  d->cuDeviceGetCount(&count);
  checks.push_back(Make(
      "cuda.driver", Result::kOk,
      absl::StrFormat("CUDA driver API %d.%d, %d device(s); built with CUDA %d.%d", version / 1000,
                      version % 1000 / 10, count, CUDA_VERSION / 1000, CUDA_VERSION % 1000 / 10)));
  if (version < CUDA_VERSION) {
    checks.back().result = Result::kFail;
    checks.back().fix = "install a driver for this CUDA version or newer";
  }
  if (count == 0) {
    for (const char* n : kNames) checks.push_back(Make(n, Result::kSkip, "no CUDA device"));
    return checks;
  }
  std::string devices;
  for (int i = 0; i < count; ++i) {
    CUdevice dev;
    char name[256] = {};
    size_t memory = 0;
    CUuuid uuid{};
    int vmm = 0, fd_handles = 0;
    d->cuDeviceGet(&dev, i);
    d->cuDeviceGetName(name, sizeof(name) - 1, dev);
    d->cuDeviceTotalMem(&memory, dev);
    d->cuDeviceGetUuid(&uuid, dev);
    d->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
    d->cuDeviceGetAttribute(&fd_handles,
                            CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
    absl::StrAppend(&devices, i == 0 ? "" : "; ", i, ": ", name, " ", CudaDriver::UuidString(uuid),
                    " ", FormatSize(memory), vmm && fd_handles ? "" : " (no VMM fd export)");
  }
  checks.push_back(Make("cuda.devices", Result::kOk, devices));

  Context ctx(d);
  if (!ctx.status().ok()) {
    checks.push_back(
        Make("cuda.host_register", Result::kFail, std::string(ctx.status().message())));
    return checks;
  }

  // Host memory shared with the daemon, registered for DMA.
  {
    SharedPage page(2 << 20);
    absl::Status s = page.base == nullptr
                         ? absl::InternalError("memfd: " + Errno(errno))
                         : d->Check(d->cuMemHostRegister(
                                        page.base, page.size,
                                        CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
                                    "cuMemHostRegister");
    if (s.ok()) {
      d->cuMemHostUnregister(page.base);
      checks.push_back(Make("cuda.host_register", Result::kOk,
                            "cuMemHostRegister pins shared memfd memory for DMA"));
    } else {
      checks.push_back(Make("cuda.host_register", Result::kFail, std::string(s.message()),
                            "copies to and from host chunks stage through the driver (slower) and "
                            "GPU stream waits are unavailable; raise the memlock limit, or run "
                            "outside a sandbox that refuses pinning"));
    }
  }

  // Device memory exported as a file descriptor (the daemon's way) and imported by another
  // process.
  {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ctx.device();
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t size = 0;
    CUmemGenericAllocationHandle handle = 0;
    CUdeviceptr ptr = 0;
    int fd = -1;
    absl::Status s =
        d->Check(d->cuMemGetAllocationGranularity(&size, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                 "cuMemGetAllocationGranularity");
    if (s.ok()) s = d->Check(d->cuMemCreate(&handle, size, &prop, 0), "cuMemCreate");
    if (s.ok()) {
      s = d->Check(
          d->cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle");
    }
    if (s.ok()) s = d->Check(d->cuMemAddressReserve(&ptr, size, 0, 0, 0), "cuMemAddressReserve");
    if (s.ok()) s = d->Check(d->cuMemMap(ptr, size, 0, handle, 0), "cuMemMap");
    if (s.ok()) {
      CUmemAccessDesc access{};
      access.location = prop.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      s = d->Check(d->cuMemSetAccess(ptr, size, &access, 1), "cuMemSetAccess");
    }
    if (s.ok()) s = d->Check(d->cuMemsetD32(ptr, kPattern, size / 4), "cuMemsetD32");
    if (s.ok()) s = d->Check(d->cuCtxSynchronize(), "cuCtxSynchronize");
    std::string said;
    int rc = -1;
    if (s.ok()) rc = RunChild(self, "import-fd", absl::StrCat(size), fd, &said);
    if (!s.ok()) {
      checks.push_back(Make("cuda.vmm_fd_ipc", Result::kFail,
                            absl::StrCat("exporting: ", s.message()),
                            "the daemon cannot share its device pool this way"));
    } else if (rc != 0) {
      checks.push_back(Make("cuda.vmm_fd_ipc", Result::kFail,
                            absl::StrCat("another process could not import it: ", said),
                            "clients cannot map the daemon's device chunks (a sandbox that "
                            "refuses cross-process GPU memory?)"));
    } else {
      checks.push_back(Make("cuda.vmm_fd_ipc", Result::kOk,
                            "device memory exported as an fd, imported and read by another "
                            "process"));
    }
    if (ptr != 0) {
      d->cuMemUnmap(ptr, size);
      d->cuMemAddressFree(ptr, size);
    }
    if (fd >= 0) close(fd);
    if (handle != 0) d->cuMemRelease(handle);
  }

  // The legacy IPC handles (cudaIpcGetMemHandle), the fallback where fd export is refused.
  {
    CUdeviceptr ptr = 0;
    CUipcMemHandle handle{};
    absl::Status s = d->Check(d->cuMemAlloc(&ptr, 2 << 20), "cuMemAlloc");
    if (s.ok()) s = d->Check(d->cuMemsetD32(ptr, kPattern, (2 << 20) / 4), "cuMemsetD32");
    if (s.ok()) s = d->Check(d->cuCtxSynchronize(), "cuCtxSynchronize");
    if (s.ok()) s = d->Check(d->cuIpcGetMemHandle(&handle, ptr), "cuIpcGetMemHandle");
    std::string said;
    int rc = -1;
    if (s.ok()) {
      std::string hex;
      for (unsigned char c : handle.reserved) absl::StrAppendFormat(&hex, "%02x", c);
      rc = RunChild(self, "import-ipc", hex, -1, &said);
    }
    if (!s.ok() || rc != 0) {
      checks.push_back(Make("cuda.legacy_ipc", Result::kWarn,
                            s.ok() ? absl::StrCat("another process could not open it: ", said)
                                   : std::string(s.message()),
                            "only the fd export above can share device memory here"));
    } else {
      checks.push_back(Make("cuda.legacy_ipc", Result::kOk,
                            "a cuIpcGetMemHandle handle opened and read by another process"));
    }
    if (ptr != 0) d->cuMemFree(ptr);
  }

  // A GPU stream waiting on a word of shared host memory, released by another process's store
  // (how clients enqueue work behind a prefetch without waiting on the host).
  {
    SharedPage page(4096);
    CUstream stream = nullptr;
    CUevent event = nullptr;
    CUdeviceptr word = 0;
    bool registered = false;
    absl::Status s =
        page.base == nullptr ? absl::InternalError("memfd: " + Errno(errno)) : absl::OkStatus();
    if (s.ok()) {
      s = d->Check(d->cuMemHostRegister(page.base, page.size,
                                        CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
                   "cuMemHostRegister");
      registered = s.ok();
    }
    if (s.ok()) {
      s = d->Check(d->cuMemHostGetDevicePointer(&word, page.base, 0), "cuMemHostGetDevicePointer");
    }
    if (s.ok()) s = d->Check(d->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    if (s.ok()) {
      s = d->Check(d->cuStreamWaitValue32(stream, word, 1, CU_STREAM_WAIT_VALUE_GEQ),
                   "cuStreamWaitValue32");
    }
    if (s.ok()) s = d->Check(d->cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    if (s.ok()) s = d->Check(d->cuEventRecord(event, stream), "cuEventRecord");
    bool waited = false, released = false;
    std::string said;
    absl::Duration took;
    if (s.ok()) {
      absl::SleepFor(absl::Milliseconds(20));
      waited = d->cuEventQuery(event) == CUDA_ERROR_NOT_READY;
      const absl::Time start = absl::Now();
      const int rc = RunChild(self, "write-word", "1", page.fd, &said);
      while (rc == 0 && absl::Now() - start < absl::Seconds(5)) {
        if (d->cuEventQuery(event) == CUDA_SUCCESS) {
          released = true;
          break;
        }
        absl::SleepFor(absl::Microseconds(100));
      }
      took = absl::Now() - start;
      // Whatever happened, let the stream go before it is destroyed.
      reinterpret_cast<std::atomic<uint32_t>*>(page.base)->store(1, std::memory_order_release);
      d->cuStreamSynchronize(stream);
    }
    if (!s.ok()) {
      checks.push_back(Make("cuda.stream_wait", Result::kFail, std::string(s.message()),
                            "GPU stream waits are unavailable: clients wait on the host"));
    } else if (!waited || !released) {
      checks.push_back(Make(
          "cuda.stream_wait", Result::kFail,
          !waited ? "the stream did not wait for the word"
                  : absl::StrCat("the stream did not see another process's write in 5 s ", said),
          "GPU stream waits are unavailable here: clients must wait on the host (Wait)"));
    } else {
      checks.push_back(Make("cuda.stream_wait", Result::kOk,
                            absl::StrFormat("cuStreamWaitValue32 released by another process's "
                                            "write in %.1f ms",
                                            absl::ToDoubleMilliseconds(took))));
    }
    if (event != nullptr) d->cuEventDestroy(event);
    if (stream != nullptr) d->cuStreamDestroy(stream);
    if (registered) d->cuMemHostUnregister(page.base);
  }
  return checks;
}

int ProbeChild(const std::string& probe, const std::string& argument) {
  if (probe == "write-word") {
    void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, 3, 0);
    if (p == MAP_FAILED) {
      std::printf("mmap: %s\n", strerror(errno));
      return 1;
    }
    absl::SleepFor(absl::Milliseconds(10));
    reinterpret_cast<std::atomic<uint32_t>*>(p)->store(1, std::memory_order_release);
    return 0;
  }
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  if (!driver.ok()) {
    std::printf("%s\n", std::string(driver.status().message()).c_str());
    return 1;
  }
  const CudaDriver* d = *driver;
  Context ctx(d);
  if (!ctx.status().ok()) {
    std::printf("%s\n", std::string(ctx.status().message()).c_str());
    return 1;
  }
  CUdeviceptr ptr = 0;
  uint64_t size = 0;
  absl::Status s;
  CUmemGenericAllocationHandle handle = 0;
  if (probe == "import-fd") {
    if (!absl::SimpleAtoi(argument, &size) || size == 0) return 2;
    s = d->Check(d->cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(uintptr_t{3}),
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                 "cuMemImportFromShareableHandle");
    if (s.ok()) s = d->Check(d->cuMemAddressReserve(&ptr, size, 0, 0, 0), "cuMemAddressReserve");
    if (s.ok()) s = d->Check(d->cuMemMap(ptr, size, 0, handle, 0), "cuMemMap");
    if (s.ok()) {
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = ctx.device();
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      s = d->Check(d->cuMemSetAccess(ptr, size, &access, 1), "cuMemSetAccess");
    }
  } else if (probe == "import-ipc") {
    CUipcMemHandle h{};
    if (argument.size() != 2 * sizeof(h.reserved)) return 2;
    for (size_t i = 0; i < sizeof(h.reserved); ++i) {
      h.reserved[i] = static_cast<char>(std::stoi(argument.substr(2 * i, 2), nullptr, 16));
    }
    s = d->Check(d->cuIpcOpenMemHandle(&ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                 "cuIpcOpenMemHandle");
    size = 2 << 20;
  } else {
    std::printf("unknown probe %s\n", probe.c_str());
    return 2;
  }
  uint32_t words[4] = {};
  if (s.ok())
    s = d->Check(d->cuMemcpyDtoH(words, ptr + size - sizeof(words), sizeof(words)), "cuMemcpyDtoH");
  if (s.ok() && (words[0] != kPattern || words[3] != kPattern)) {
    s = absl::DataLossError(absl::StrFormat("read 0x%08x, not 0x%08x", words[0], kPattern));
  }
  if (probe == "import-ipc" && ptr != 0) d->cuIpcCloseMemHandle(ptr);
  if (probe == "import-fd") {
    if (ptr != 0) {
      d->cuMemUnmap(ptr, size);
      d->cuMemAddressFree(ptr, size);
    }
    if (handle != 0) d->cuMemRelease(handle);
  }
  std::printf("%s\n", s.ok() ? "ok" : std::string(s.message()).c_str());
  return s.ok() ? 0 : 1;
}

#else  // !TIERD_HAVE_CUDA

std::vector<Check> CudaChecks(const std::string&) {
  std::vector<Check> checks;
  checks.push_back(Make("cuda.driver", Result::kSkip, "this tierctl was built without CUDA",
                        "use a build with the CUDA toolkit (or the GPU kit) to check the GPU"));
  for (const char* n : {"cuda.devices", "cuda.host_register", "cuda.vmm_fd_ipc", "cuda.legacy_ipc",
                        "cuda.stream_wait"}) {
    checks.push_back(Make(n, Result::kSkip, "built without CUDA"));
  }
  return checks;
}

int ProbeChild(const std::string& probe, const std::string&) {
  std::printf("built without CUDA: no probe %s\n", probe.c_str());
  return 1;
}

#endif  // TIERD_HAVE_CUDA

}  // namespace

const char* ResultName(Result r) {
  switch (r) {
    case Result::kOk:
      return "ok";
    case Result::kWarn:
      return "warn";
    case Result::kFail:
      return "fail";
    case Result::kSkip:
      return "skip";
  }
  return "?";
}

std::vector<Check> Run(const Options& options) {
  std::vector<Check> checks;
  const std::string dir = !options.socket_dir.empty() ? options.socket_dir
                          : std::getenv("TIERD_SOCKET_DIR") != nullptr
                              ? std::getenv("TIERD_SOCKET_DIR")
                              : "/run/tierd";
  // What the daemon serves, when it answers: its host capacity and NVMe regions.
  uint64_t host_capacity = options.host_capacity;
  std::vector<std::string> regions = options.regions;
  auto client = Client::Connect({.socket_dir = dir, .client_name = "tierctl-doctor"});
  if (client.ok()) {
    auto info = (*client)->GetNodeInfo();
    if (info.ok()) {
      checks.push_back(Make("daemon", Result::kOk,
                            absl::StrCat("tierd ", info->version, " answers on ", dir, " (",
                                         info->sessions, " sessions)")));
      if (const TierStatus* host = info->tier(Tier::kHost); host != nullptr && host_capacity == 0) {
        host_capacity = host->capacity_bytes;
      }
      if (const TierStatus* nvme = info->tier(Tier::kNvme); nvme != nullptr && regions.empty()) {
        for (const RegionStatus& r : nvme->regions) regions.push_back(r.path);
      }
    } else {
      checks.push_back(
          Make("daemon", Result::kWarn,
               absl::StrCat("connected but GetNodeInfo failed: ", info.status().message())));
    }
  } else {
    checks.push_back(
        Make("daemon", Result::kWarn,
             absl::StrCat("no daemon answers on ", dir, ": ", client.status().message()),
             "start it (systemctl start tierd, or make demo); the checks below do "
             "not need it"));
  }
  client = absl::UnavailableError("done");  // closes the session before the probes

  checks.push_back(Sockets(dir));
  checks.push_back(IoUring());
  if (regions.empty()) {
    checks.push_back(Make("o_direct", Result::kSkip, "no NVMe region named",
                          "pass --regions=PATH[,PATH] (or start the daemon) to check them"));
  }
  for (const std::string& r : regions) checks.push_back(ODirect(r));
  checks.push_back(Memlock(host_capacity));
  checks.push_back(HugePages(host_capacity));
  for (Check& c : CudaChecks(options.self)) checks.push_back(std::move(c));
  return checks;
}

int RunProbeChild(const std::string& probe, const std::string& argument) {
  return ProbeChild(probe, argument);
}

}  // namespace tierd::doctor
