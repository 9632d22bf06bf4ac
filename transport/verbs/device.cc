// Device, port and GID selection, capabilities, the max_inline_data probe and
// the memory-registration diagnostics of the verbs provider.
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <net/if.h>
#include <rdma/rdma_cma.h>
#include <rdma/siw-abi.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/log.h"
#include "transport/verbs/internal.h"

namespace coverbs::transport::verbs_internal {
namespace {

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::string(v) : fallback;
}

std::string ReadSysfsLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (in) std::getline(in, line);
  return std::string(absl::StripAsciiWhitespace(line));
}

// ---------------------------------------------------------------- GIDs

struct GidInfo {
  int index = -1;
  ibv_gid gid{};
  int type = -1;  // enum ibv_gid_type, -1 unknown
  uint32_t ndev_ifindex = 0;
};

// The port's valid GID entries: ibv_query_gid_table, else (old kernels) one
// ibv_query_gid per index with the type from sysfs.
std::vector<GidInfo> ReadGidTable(const Device& dev) {
  std::vector<GidInfo> out;
  size_t max_entries = 0;
  for (int p = 1; p <= dev.attr.phys_port_cnt; ++p) {
    ibv_port_attr pa{};
    if (ibv_query_port(dev.ctx, p, &pa) == 0) max_entries += pa.gid_tbl_len;
  }
  if (max_entries > 0) {
    std::vector<ibv_gid_entry> entries(max_entries);
    ssize_t n = ibv_query_gid_table(dev.ctx, entries.data(), entries.size(), 0);
    if (n >= 0) {
      for (ssize_t i = 0; i < n; ++i) {
        const ibv_gid_entry& e = entries[i];
        if (e.port_num != dev.port || GidIsZero(e.gid)) continue;
        out.push_back(GidInfo{static_cast<int>(e.gid_index), e.gid,
                              static_cast<int>(e.gid_type), e.ndev_ifindex});
      }
      return out;
    }
  }
  const std::string base =
      absl::StrFormat("/sys/class/infiniband/%s/ports/%d", dev.name, dev.port);
  for (int i = 0; i < dev.port_attr.gid_tbl_len; ++i) {
    GidInfo g;
    g.index = i;
    if (ibv_query_gid(dev.ctx, dev.port, i, &g.gid) != 0 || GidIsZero(g.gid)) {
      continue;
    }
    std::string type =
        ReadSysfsLine(absl::StrFormat("%s/gid_attrs/types/%d", base, i));
    if (type == "RoCE v2") {
      g.type = IBV_GID_TYPE_ROCE_V2;
    } else if (type == "IB/RoCE v1") {
      g.type = dev.port_attr.link_layer == IBV_LINK_LAYER_ETHERNET
                   ? IBV_GID_TYPE_ROCE_V1
                   : IBV_GID_TYPE_IB;
    }
    std::string ndev =
        ReadSysfsLine(absl::StrFormat("%s/gid_attrs/ndevs/%d", base, i));
    if (!ndev.empty()) g.ndev_ifindex = if_nametoindex(ndev.c_str());
    out.push_back(g);
  }
  return out;
}

int GidScore(const GidInfo& g) {
  bool v2 = g.type == IBV_GID_TYPE_ROCE_V2;
  bool v4 = GidIsIpv4Mapped(g.gid);
  return (v2 ? 2 : 0) + (v4 ? 1 : 0);
}

absl::Status ChooseGid(Device& dev, const ProviderOptions& options) {
  int forced = options.gid_index;
  if (forced < 0) {
    std::string env = EnvOr("COVERBS_GID_INDEX", "");
    if (!env.empty() && !absl::SimpleAtoi(env, &forced)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "COVERBS_GID_INDEX=\"%s\" is not a GID index (an integer)", env));
    }
  }
  std::vector<GidInfo> table = ReadGidTable(dev);
  const GidInfo* chosen = nullptr;
  if (forced >= 0) {
    if (forced >= dev.port_attr.gid_tbl_len) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GID index %d is out of range on %s port %d (GID table length %d)",
          forced, dev.name, dev.port, dev.port_attr.gid_tbl_len));
    }
    for (const GidInfo& g : table) {
      if (g.index == forced) chosen = &g;
    }
    if (chosen == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GID index %d on %s port %d is empty (no address behind it)", forced,
          dev.name, dev.port));
    }
  } else {
    for (const GidInfo& g : table) {
      if (chosen == nullptr || GidScore(g) > GidScore(*chosen)) chosen = &g;
    }
    if (chosen == nullptr) {
      return absl::UnavailableError(absl::StrFormat(
          "%s port %d (RoCE) has no valid GID: give its netdev an IP address",
          dev.name, dev.port));
    }
  }
  dev.caps.gid_index = chosen->index;
  dev.gid = chosen->gid;
  dev.ndev_ifindex = chosen->ndev_ifindex;
  if (GidIsIpv4Mapped(chosen->gid)) {
    in_addr a;
    std::memcpy(&a, &chosen->gid.raw[12], sizeof(a));
    dev.gid_ipv4 = a;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- inline

bool TryInline(ibv_pd* pd, ibv_cq* cq, uint32_t want, uint32_t* got) {
  ibv_qp_init_attr attr{};
  attr.send_cq = cq;
  attr.recv_cq = cq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = 1;
  attr.cap.max_recv_wr = 1;
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 1;
  attr.cap.max_inline_data = want;
  ibv_qp* qp = ibv_create_qp(pd, &attr);
  if (qp == nullptr) return false;
  *got = attr.cap.max_inline_data;
  ibv_destroy_qp(qp);
  return true;
}

// ibv_device_attr has no inline limit and drivers differ (rxe and siw reject
// a QP asking too much; others round up): find the largest accepted value by
// creating tiny QPs, and report what the driver says it gave. Cached per
// device (name + GUID) for the life of the process.
uint32_t ProbeMaxInline(const Device& dev) {
  static std::mutex mu;
  static auto* cache = new std::map<std::string, uint32_t>();
  const std::string key = absl::StrCat(
      dev.name, "/", be64toh(ibv_get_device_guid(dev.ctx->device)));
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache->find(key); it != cache->end()) return it->second;

  uint32_t result = 0;
  ibv_pd* pd = ibv_alloc_pd(dev.ctx);
  ibv_cq* cq =
      pd != nullptr ? ibv_create_cq(dev.ctx, 4, nullptr, nullptr, 0) : nullptr;
  if (pd != nullptr && cq != nullptr) {
    uint32_t got = 0;
    constexpr uint32_t kMax = 4096;
    if (TryInline(pd, cq, kMax, &got)) {
      result = got;
    } else if (TryInline(pd, cq, 0, &got)) {
      // Largest accepted request in [lo, hi): lo accepted, hi rejected.
      uint32_t lo = 0, hi = kMax;
      result = got;
      while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (TryInline(pd, cq, mid, &got)) {
          lo = mid;
          result = got > mid ? got : mid;
        } else {
          hi = mid;
        }
      }
    }
  }
  if (cq != nullptr) ibv_destroy_cq(cq);
  if (pd != nullptr) ibv_dealloc_pd(pd);
  (*cache)[key] = result;
  return result;
}

// SoftiWARP: libsiw (rdma-core 44, Debian 12) takes a queue mapped at offset
// SIW_INVAL_UOBJ_KEY (0x90000, the old ABI's "no mapping" key) for a
// failure, but Linux 6.1's siw hands out mmap offsets page by page per
// ibv_context, first fit, and 0x90000 is simply the 145th page. The QP, CQ
// or SRQ whose queue lands there fails (libsiw destroys it; errno 0, so
// rdma_create_qp says EINVAL), and so does every later one, as that page is
// then the first free one again: with two 4096-entry CQs the 40th QP of the
// process failed, and larger CQs made it sooner. A CQ whose queue covers the
// offset, made before anything else on the context and kept for the life of
// the process (the context is librdmacm's and lives as long), takes the
// offset for good: 1 MiB of memory; 600 QPs were created after it in the VM
// (39 before). The CQs are kept here so that they stay reachable.
void PlugSiwMmapOffset(ibv_context* ctx, const std::string& name) {
  static std::mutex mu;
  static auto* plugs = new std::map<ibv_context*, ibv_cq*>();
  std::lock_guard<std::mutex> lock(mu);
  if (plugs->count(ctx) != 0) return;
  constexpr int kCqe = static_cast<int>((SIW_INVAL_UOBJ_KEY + 2 * 4096) /
                                        sizeof(struct siw_cqe));
  ibv_cq* cq = ibv_create_cq(ctx, kCqe, nullptr, nullptr, 0);
  if (cq == nullptr) {
    COVERBS_LOG(kWarning, "verbs",
                "%s: could not reserve siw's mmap offset 0x%x "
                "(ibv_create_cq(%d): %s); QP creation may fail once about "
                "40 QPs exist",
                name, SIW_INVAL_UOBJ_KEY, kCqe, std::strerror(errno));
  }
  (*plugs)[ctx] = cq;
}

// ---------------------------------------------------------------- open

struct DeviceList {
  ibv_context** list = nullptr;
  ~DeviceList() {
    if (list != nullptr) rdma_free_devices(list);
  }
};

std::string PortStates(ibv_context* ctx) {
  ibv_device_attr attr{};
  if (ibv_query_device(ctx, &attr) != 0) return "(ibv_query_device failed)";
  std::vector<std::string> parts;
  for (int p = 1; p <= attr.phys_port_cnt; ++p) {
    ibv_port_attr pa{};
    if (ibv_query_port(ctx, p, &pa) != 0) {
      parts.push_back(absl::StrFormat("port %d ?", p));
    } else {
      parts.push_back(
          absl::StrFormat("port %d %s", p, ibv_port_state_str(pa.state)));
    }
  }
  return absl::StrJoin(parts, ", ");
}

}  // namespace

absl::StatusOr<std::shared_ptr<Device>> OpenDevice(
    const ProviderOptions& options) {
  // 1. Does libibverbs see any device at all?
  int num = 0;
  errno = 0;
  ibv_device** ibv_list = ibv_get_device_list(&num);
  if (ibv_list == nullptr) {
    int err = errno != 0 ? errno : ENODEV;
    return absl::UnavailableError(absl::StrFormat(
        "no RDMA device: ibv_get_device_list failed: %s (errno %d); the kernel "
        "has no RDMA support (ib_uverbs) here. Use the soft provider "
        "(COVERBS_PROVIDER=soft)",
        std::strerror(err), err));
  }
  std::vector<std::string> ibv_names;
  for (int i = 0; i < num; ++i) {
    ibv_names.push_back(ibv_get_device_name(ibv_list[i]));
  }
  ibv_free_device_list(ibv_list);
  if (num == 0) {
    return absl::NotFoundError(
        "no RDMA device: ibv_get_device_list found none (no RDMA NIC, and no "
        "soft device such as Soft-RoCE or SoftiWARP: `rdma link add rxe0 type "
        "rxe netdev <if>`). Use the soft provider (COVERBS_PROVIDER=soft)");
  }

  // 2. Open them through librdmacm, whose contexts rdma_cm ids use.
  DeviceList devices;
  int cm_num = 0;
  errno = 0;
  devices.list = rdma_get_devices(&cm_num);
  if (devices.list == nullptr || cm_num == 0) {
    int err = errno != 0 ? errno : ENODEV;
    return absl::UnavailableError(absl::StrFormat(
        "RDMA devices exist (%s) but librdmacm cannot open them: "
        "rdma_get_devices: %s (errno %d); is the rdma_ucm module loaded "
        "(/dev/infiniband/rdma_cm)?",
        absl::StrJoin(ibv_names, ", "), std::strerror(err), err));
  }

  // 3. Pick the device and port.
  const std::string want =
      options.device.empty() ? EnvOr("COVERBS_DEVICE", "") : options.device;
  auto dev = std::make_shared<Device>();
  std::vector<std::string> seen;
  for (int i = 0; i < cm_num && dev->ctx == nullptr; ++i) {
    ibv_context* ctx = devices.list[i];
    const std::string name = ibv_get_device_name(ctx->device);
    seen.push_back(absl::StrFormat("%s (%s)", name, PortStates(ctx)));
    if (!want.empty() && name != want) continue;
    ibv_device_attr attr{};
    if (int ret = ibv_query_device(ctx, &attr); ret != 0) {
      if (!want.empty()) {
        const int err = VerbsErrno(ret, errno);
        return ErrnoStatus(err, absl::StrCat("ibv_query_device on ", name));
      }
      continue;
    }
    int port = 0;
    ibv_port_attr port_attr{};
    if (options.port != 0) {
      if (options.port > attr.phys_port_cnt) {
        return absl::InvalidArgumentError(
            absl::StrFormat("port %d does not exist on %s (it has %d)",
                            options.port, name, attr.phys_port_cnt));
      }
      if (ibv_query_port(ctx, options.port, &port_attr) == 0 &&
          port_attr.state == IBV_PORT_ACTIVE) {
        port = options.port;
      } else if (!want.empty()) {
        return absl::UnavailableError(
            absl::StrFormat("%s port %d is not ACTIVE (%s)", name, options.port,
                            PortStates(ctx)));
      }
    } else {
      for (int p = 1; p <= attr.phys_port_cnt; ++p) {
        if (ibv_query_port(ctx, p, &port_attr) == 0 &&
            port_attr.state == IBV_PORT_ACTIVE) {
          port = p;
          break;
        }
      }
      if (port == 0 && !want.empty()) {
        return absl::UnavailableError(absl::StrFormat(
            "%s has no ACTIVE port (%s)", name, PortStates(ctx)));
      }
    }
    if (port == 0) continue;
    dev->ctx = ctx;
    dev->name = name;
    dev->port = static_cast<uint8_t>(port);
    dev->attr = attr;
    dev->port_attr = port_attr;
  }
  if (dev->ctx == nullptr) {
    if (!want.empty()) {
      return absl::NotFoundError(absl::StrFormat(
          "RDMA device \"%s\" not found%s; devices: %s", want,
          options.device.empty() ? " (from COVERBS_DEVICE)" : "",
          absl::StrJoin(seen, ", ")));
    }
    return absl::UnavailableError(absl::StrFormat(
        "no RDMA device has an ACTIVE port: %s", absl::StrJoin(seen, ", ")));
  }
  dev->list = devices.list;  // the Device releases the list from now on
  devices.list = nullptr;

  // 4. Capabilities.
  DeviceCaps& caps = dev->caps;
  caps.provider = "verbs";
  caps.device_name = dev->name;
  caps.port = dev->port;
  const ibv_device* d = dev->ctx->device;
  if (d->transport_type == IBV_TRANSPORT_IWARP ||
      d->node_type == IBV_NODE_RNIC) {
    caps.transport = TransportKind::kIWarp;
  } else if (dev->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET) {
    caps.transport = TransportKind::kRoCE;
  } else {
    caps.transport = TransportKind::kInfiniBand;
  }
  const ibv_device_attr& a = dev->attr;
  caps.max_qp_wr = a.max_qp_wr > 0 ? a.max_qp_wr : 0;
  caps.max_sge = a.max_sge > 0 ? a.max_sge : 0;
  caps.max_sge_rd = a.max_sge_rd > 0 ? a.max_sge_rd : caps.max_sge;
  caps.max_cqe = a.max_cqe > 0 ? a.max_cqe : 0;
  caps.max_srq_wr = a.max_srq_wr > 0 ? a.max_srq_wr : 0;
  caps.max_mr_size = a.max_mr_size;
  int rd_atom = std::min(a.max_qp_rd_atom, a.max_qp_init_rd_atom);
  caps.max_qp_rd_atom = rd_atom > 0 ? rd_atom : 0;
  caps.atomics = a.atomic_cap != IBV_ATOMIC_NONE;
  const bool iwarp = caps.transport == TransportKind::kIWarp;
  caps.write_with_imm = !iwarp;
  caps.send_with_imm = !iwarp;
  caps.active_side_sends_first = iwarp;
  // Type 2A or 2B windows (rxe: 2B; siw: none).
  caps.memory_windows =
      (a.device_cap_flags &
       (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0;
  caps.send_with_invalidate = true;  // IB, RoCE and iWARP all have it
  caps.gid_index = -1;
  constexpr uint32_t kSiwVendorId = 0x626d74;  // "bmt": SoftiWARP
  constexpr uint32_t kRxeVendorId = 0xffffff;  // RXE_VENDOR_ID
  dev->wc_flags_kernel_encoded = dev->attr.vendor_id == kRxeVendorId &&
                                 caps.transport == TransportKind::kRoCE;
  dev->posts_after_error_unflushed =
      iwarp && dev->attr.vendor_id == kSiwVendorId;
  // siw returns the data of an RDMA READ whatever the target region's
  // access flags (seen on Linux 6.1; tests/transport/conformance_test.cc).
  caps.enforces_remote_read = !(iwarp && dev->attr.vendor_id == kSiwVendorId);
  if (caps.transport == TransportKind::kRoCE) {
    if (absl::Status s = ChooseGid(*dev, options); !s.ok()) return s;
  }
  if (iwarp && dev->attr.vendor_id == kSiwVendorId) {
    PlugSiwMmapOffset(dev->ctx, dev->name);  // before any other object
  }
  caps.max_inline_data = ProbeMaxInline(*dev);

  // 5. Asynchronous events: a non-blocking fd for the reactor. The context is
  // librdmacm's and shared by every provider opened on this device in the
  // process: whoever reads an event consumes it.
  int fl = fcntl(dev->ctx->async_fd, F_GETFL);
  if (fl < 0 || fcntl(dev->ctx->async_fd, F_SETFL, fl | O_NONBLOCK) < 0) {
    const int err = errno;
    return ErrnoStatus(
        err,
        absl::StrCat("fcntl(O_NONBLOCK) on the async event fd of ", dev->name));
  }
  return dev;
}

// ---------------------------------------------------------------- reg_mr

namespace {

// The value of `field` ("VmPin:", "CapEff:") in /proc/self/status, trimmed;
// empty when absent.
std::string ProcStatusField(absl::string_view field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view v = line;
    if (absl::ConsumePrefix(&v, field)) {
      return std::string(absl::StripAsciiWhitespace(v));
    }
  }
  return "";
}

// Memory already pinned by the process (VmPin: what ib_umem and siw count
// against RLIMIT_MEMLOCK), in bytes; -1 when unknown.
long long PinnedBytes() {
  const std::string field = ProcStatusField("VmPin:");
  absl::string_view v = field;
  absl::ConsumeSuffix(&v, "kB");
  long long kb = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &kb)) return -1;
  return kb * 1024;
}

// Whether the effective capability set holds CAP_IPC_LOCK (bit 14), which
// lifts RLIMIT_MEMLOCK for registrations.
bool HasIpcLock() {
  uint64_t caps = 0;
  if (!absl::SimpleHexAtoi(ProcStatusField("CapEff:"), &caps)) return false;
  return (caps >> 14) & 1;
}

std::string Bytes(unsigned long long n) {
  if (n >= (1ull << 30) && n % (1ull << 30) == 0) {
    return absl::StrFormat("%llu GiB", n >> 30);
  }
  if (n >= (1ull << 20) && n % (1ull << 20) == 0) {
    return absl::StrFormat("%llu MiB", n >> 20);
  }
  if (n >= 1024 && n % 1024 == 0) return absl::StrFormat("%llu KiB", n >> 10);
  return absl::StrFormat("%llu bytes", n);
}

}  // namespace

absl::Status RegMrError(int err, const Device& dev, void* addr, size_t length,
                        int access) {
  const std::string what =
      absl::StrFormat("ibv_reg_mr(addr=%p, length=%zu, access=0x%x) on %s",
                      addr, length, access, dev.name);
  if (err == ENOMEM || err == EPERM || err == EFAULT) {
    rlimit rl{};
    if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        !HasIpcLock()) {
      const long page = sysconf(_SC_PAGESIZE);
      const uintptr_t begin = reinterpret_cast<uintptr_t>(addr) & ~(page - 1);
      const uintptr_t end =
          (reinterpret_cast<uintptr_t>(addr) + length + page - 1) & ~(page - 1);
      const unsigned long long need = end - begin;
      const long long pinned = PinnedBytes();
      // The limit is the likely cause when the registration would not fit
      // (or when we cannot tell what is pinned already).
      if (pinned < 0 || pinned + need > rl.rlim_cur) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "%s failed: %s (errno %d): the locked-memory limit RLIMIT_MEMLOCK "
            "is %s (`ulimit -l` = %llu) and this registration needs %zu bytes "
            "(%s in pages) on top of %s already pinned; raise it (`ulimit -l "
            "unlimited`, limits.conf memlock, systemd LimitMEMLOCK) or run "
            "with CAP_IPC_LOCK",
            what, std::strerror(err), err, Bytes(rl.rlim_cur),
            static_cast<unsigned long long>(rl.rlim_cur / 1024), length,
            Bytes(need), pinned < 0 ? "an unknown amount" : Bytes(pinned)));
      }
    }
  }
  return ErrnoStatus(err, what);
}

}  // namespace coverbs::transport::verbs_internal
