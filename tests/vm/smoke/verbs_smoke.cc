// verbs_smoke: end-to-end check that a kernel RDMA stack is usable from user space.
//
//   verbs_smoke [--list] [SERVER_ADDR [CLIENT_ADDR [PORT]]]
//
// 1. Lists the verbs devices, opens the first one (or $COVERBS_VM_DEV) and prints
//    its device and port attributes.
// 2. Unless --list: an RC connection over rdma_cm inside this one process. A
//    server thread listens on SERVER_ADDR (default $COVERBS_VM_ADDR_A); the
//    client binds CLIENT_ADDR (default $COVERBS_VM_ADDR_B) and connects. The
//    server advertises a buffer (address, rkey) in the accept private data, then
//    the client does and verifies:
//      RDMA_WRITE of a pattern, SEND of a message (its arrival also proves the
//      preceding WRITE landed, RC ordering), RDMA_READ back, and on transports
//      with immediate data (not iWARP: siw rejects it) WRITE_WITH_IMM and
//      SEND_WITH_IMM.
// Exit status: 0 all checks passed, 1 a check failed, 2 usage, 3 no device.
// A watchdog ends the process if anything hangs (default 60 s,
// $VERBS_SMOKE_TIMEOUT).
//
// Build: g++ -std=c++20 -O2 -Wall verbs_smoke.cc -o verbs_smoke -libverbs -lrdmacm -pthread
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#include <arpa/inet.h>
#include <endian.h>
#include <netdb.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <latch>
#include <span>
#include <string>
#include <string_view>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;
const Clock::time_point g_start = Clock::now();

double elapsed_ms() {
    return std::chrono::duration<double, std::milli>(Clock::now() - g_start).count();
}

void say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void say(const char* fmt, ...) {
    std::printf("[%8.1f ms] ", elapsed_ms());
    va_list ap;
    va_start(ap, fmt);
    std::vprintf(fmt, ap);
    va_end(ap);
    std::fputc('\n', stdout);
    std::fflush(stdout);
}

// Any failure ends the process right away: the other thread may sit in a
// blocking rdma_cm call that nothing else would ever wake.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] void fail(const char* fmt, ...) {
    std::printf("[%8.1f ms] FAIL: ", elapsed_ms());
    va_list ap;
    va_start(ap, fmt);
    std::vprintf(fmt, ap);
    va_end(ap);
    std::fputc('\n', stdout);
    std::fflush(stdout);
    _exit(1);
}

std::atomic<int> g_checks{0};
void pass(const char* what) {
    ++g_checks;
    say("PASS %s", what);
}

const char* env_or(const char* name, const char* fallback) {
    const char* v = std::getenv(name);
    return v && *v ? v : fallback;
}

const char* transport_name(ibv_transport_type t) {
    switch (t) {
        case IBV_TRANSPORT_IB: return "IB/RoCE";
        case IBV_TRANSPORT_IWARP: return "iWARP";
        default: return "other";
    }
}

std::string gid_string(const ibv_gid& gid) {
    char buf[INET6_ADDRSTRLEN] = {};
    inet_ntop(AF_INET6, gid.raw, buf, sizeof buf);
    return buf;
}

// ---------------------------------------------------------------- device listing

int list_devices() {
    int n = 0;
    ibv_device** raw = ibv_get_device_list(&n);
    if (!raw) {
        std::printf("ibv_get_device_list: %s\n", std::strerror(errno));
        return 3;
    }
    std::span devices(raw, static_cast<size_t>(n));
    std::printf("%d RDMA device(s):", n);
    for (ibv_device* d : devices) std::printf(" %s(%s)", ibv_get_device_name(d), transport_name(d->transport_type));
    std::printf("\n");
    if (n == 0) {
        ibv_free_device_list(raw);
        std::printf("FAIL: no RDMA device (is a provider loaded and `rdma link add` done?)\n");
        return 3;
    }

    ibv_device* chosen = devices[0];
    if (const char* want = std::getenv("COVERBS_VM_DEV")) {
        for (ibv_device* d : devices)
            if (std::string_view(ibv_get_device_name(d)) == want) chosen = d;
    }
    ibv_context* ctx = ibv_open_device(chosen);
    if (!ctx) {
        std::printf("FAIL: ibv_open_device(%s): %s\n", ibv_get_device_name(chosen), std::strerror(errno));
        ibv_free_device_list(raw);
        return 1;
    }
    ibv_device_attr a{};
    ibv_port_attr p{};
    if (int e = ibv_query_device(ctx, &a)) fail("ibv_query_device: %s", std::strerror(e));
    if (int e = ibv_query_port(ctx, 1, &p)) fail("ibv_query_port: %s", std::strerror(e));
    std::printf("device %s: transport=%s node_guid=%016llx fw=%s vendor=0x%x part=%u\n",
                ibv_get_device_name(chosen), transport_name(chosen->transport_type),
                static_cast<unsigned long long>(be64toh(ibv_get_device_guid(chosen))),
                a.fw_ver[0] ? a.fw_ver : "-", a.vendor_id, a.vendor_part_id);
    std::printf("  caps: max_qp=%d max_qp_wr=%d max_sge=%d max_cq=%d max_cqe=%d max_mr=%d "
                "max_mr_size=%llu max_pd=%d max_qp_rd_atom=%d atomic_cap=%d flags=0x%llx\n",
                a.max_qp, a.max_qp_wr, a.max_sge, a.max_cq, a.max_cqe, a.max_mr,
                static_cast<unsigned long long>(a.max_mr_size), a.max_pd, a.max_qp_rd_atom,
                static_cast<int>(a.atomic_cap), static_cast<unsigned long long>(a.device_cap_flags));
    std::printf("  port 1: state=%s active_mtu=%d max_mtu=%d link_layer=%s gid_tbl_len=%d max_msg_sz=%u\n",
                ibv_port_state_str(p.state), 128 << p.active_mtu, 128 << p.max_mtu,
                p.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "IB/unspecified",
                p.gid_tbl_len, p.max_msg_sz);
    for (int i = 0; i < p.gid_tbl_len; ++i) {
        ibv_gid gid{};
        if (ibv_query_gid(ctx, 1, i, &gid) != 0) break;
        static constexpr ibv_gid zero{};
        if (std::memcmp(&gid, &zero, sizeof gid) == 0) continue;
        std::printf("  gid[%d]=%s\n", i, gid_string(gid).c_str());
    }
    const bool active = p.state == IBV_PORT_ACTIVE;
    ibv_close_device(ctx);
    ibv_free_device_list(raw);
    if (!active) {
        std::printf("FAIL: port 1 is not ACTIVE\n");
        return 1;
    }
    return 0;
}

// ---------------------------------------------------------------- rdma_cm loopback

constexpr size_t kRegion = 4096;         // server buffer: WRITE/READ target
constexpr size_t kMsg = 64;              // receive slot size
constexpr int kRecvSlots = 4;
constexpr uint32_t kImm = 0xc0ffee01;
constexpr std::string_view kHello = "hello from coverbs verbs_smoke";

// Sent by the server in the accept private data (iWARP allows up to 512 bytes,
// IB CM REP 196): where the client may WRITE and READ.
struct RemoteBuf {
    uint64_t addr_be;
    uint32_t rkey_be;
    uint32_t len_be;
};

ibv_wc wait_one(ibv_cq* cq, const char* what) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    ibv_wc wc{};
    while (Clock::now() < deadline) {
        int n = ibv_poll_cq(cq, 1, &wc);
        if (n < 0) fail("%s: ibv_poll_cq returned %d", what, n);
        if (n == 1) {
            if (wc.status != IBV_WC_SUCCESS)
                fail("%s: completion status %s (vendor_err 0x%x)", what, ibv_wc_status_str(wc.status), wc.vendor_err);
            return wc;
        }
        std::this_thread::yield();
    }
    fail("%s: no completion within 10 s", what);
}

// ibv_post_send returns a positive errno, some providers a negative one.
void post_send(ibv_qp* qp, ibv_send_wr& wr, const char* what) {
    ibv_send_wr* bad = nullptr;
    if (int e = ibv_post_send(qp, &wr, &bad)) fail("%s: ibv_post_send: %s (%d)", what, std::strerror(std::abs(e)), e);
}

rdma_addrinfo* resolve(const char* addr, const char* port, bool passive, rdma_addrinfo* src) {
    rdma_addrinfo hints{};
    hints.ai_port_space = RDMA_PS_TCP;
    if (passive) hints.ai_flags = RAI_PASSIVE;
    if (src) {
        hints.ai_src_addr = src->ai_src_addr;
        hints.ai_src_len = src->ai_src_len;
    }
    rdma_addrinfo* res = nullptr;
    if (rdma_getaddrinfo(addr, port, &hints, &res))
        fail("rdma_getaddrinfo(%s, %s%s): %s", addr, port, passive ? ", passive" : "", std::strerror(errno));
    return res;
}

int loopback(const char* server_addr, const char* client_addr, const char* port) {
    say("rdma_cm loopback: server %s:%s, client %s", server_addr, port, client_addr);
    ibv_qp_init_attr qa{};
    qa.cap.max_send_wr = 8;
    qa.cap.max_recv_wr = kRecvSlots;
    qa.cap.max_send_sge = 1;
    qa.cap.max_recv_sge = 1;
    qa.qp_type = IBV_QPT_RC;
    qa.sq_sig_all = 1;

    rdma_addrinfo* sres = resolve(server_addr, port, true, nullptr);
    rdma_cm_id* listen_id = nullptr;
    if (rdma_create_ep(&listen_id, sres, nullptr, &qa)) fail("rdma_create_ep(listen): %s", std::strerror(errno));
    // Listening before the client thread exists: the client cannot race ahead
    // of the listen and get REJECTED.
    if (rdma_listen(listen_id, 1)) fail("rdma_listen(%s:%s): %s", server_addr, port, std::strerror(errno));

    // The server checks iWARP-ness on the device it got; the client needs to
    // know how many receives to expect, so it learns it after connecting.
    std::latch server_verified{1};
    std::latch client_disconnecting{1};
    std::atomic<bool> with_imm{false};

    std::jthread server([&] {
        rdma_cm_id* id = nullptr;
        if (rdma_get_request(listen_id, &id)) fail("rdma_get_request: %s", std::strerror(errno));
        const bool iwarp = id->verbs->device->transport_type == IBV_TRANSPORT_IWARP;
        static std::array<char, kRegion> region{};
        static std::array<char, kMsg * kRecvSlots> slots{};
        ibv_mr* region_mr = ibv_reg_mr(id->pd, region.data(), region.size(),
                                       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
        if (!region_mr) fail("server ibv_reg_mr: %s (check `ulimit -l`)", std::strerror(errno));
        ibv_mr* slots_mr = rdma_reg_msgs(id, slots.data(), slots.size());
        if (!slots_mr) fail("server rdma_reg_msgs: %s", std::strerror(errno));
        for (int i = 0; i < kRecvSlots; ++i)
            if (rdma_post_recv(id, reinterpret_cast<void*>(uintptr_t(i)), slots.data() + i * kMsg, kMsg, slots_mr))
                fail("rdma_post_recv: %s", std::strerror(errno));

        RemoteBuf rb{htobe64(reinterpret_cast<uintptr_t>(region.data())), htobe32(region_mr->rkey),
                     htobe32(static_cast<uint32_t>(region.size()))};
        rdma_conn_param param{};
        param.private_data = &rb;
        param.private_data_len = sizeof rb;
        param.responder_resources = 1;
        param.initiator_depth = 1;
        if (rdma_accept(id, &param)) fail("rdma_accept: %s", std::strerror(errno));
        say("server: accepted on %s (%s)", ibv_get_device_name(id->verbs->device),
            transport_name(id->verbs->device->transport_type));

        // 1: the SEND. Its arrival means the WRITE posted before it has landed.
        ibv_wc wc = wait_one(id->recv_cq, "server recv SEND");
        const char* got = slots.data() + wc.wr_id * kMsg;
        if (wc.opcode != IBV_WC_RECV || wc.byte_len != kHello.size() || std::string_view(got, wc.byte_len) != kHello)
            fail("server: SEND payload wrong (opcode %d, %u bytes, \"%.*s\")", wc.opcode, wc.byte_len,
                 static_cast<int>(std::min<size_t>(wc.byte_len, kMsg)), got);
        pass("SEND received and verified");
        for (size_t i = 0; i < 256; ++i)
            if (region[i] != static_cast<char>(i ^ 0x5a)) fail("server: RDMA_WRITE data wrong at byte %zu", i);
        pass("RDMA_WRITE data verified at the target");

        if (!iwarp) {
            wc = wait_one(id->recv_cq, "server recv WRITE_WITH_IMM");
            if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc.wc_flags & IBV_WC_WITH_IMM) || be32toh(wc.imm_data) != kImm)
                fail("server: WRITE_WITH_IMM completion wrong (opcode %d flags 0x%x imm 0x%x)", wc.opcode,
                     wc.wc_flags, be32toh(wc.imm_data));
            if (region[512] != 'W') fail("server: WRITE_WITH_IMM data missing");
            pass("RDMA_WRITE_WITH_IMM: immediate and data verified");
            wc = wait_one(id->recv_cq, "server recv SEND_WITH_IMM");
            if (wc.opcode != IBV_WC_RECV || !(wc.wc_flags & IBV_WC_WITH_IMM) || be32toh(wc.imm_data) != kImm + 1)
                fail("server: SEND_WITH_IMM completion wrong (opcode %d flags 0x%x imm 0x%x)", wc.opcode,
                     wc.wc_flags, be32toh(wc.imm_data));
            pass("SEND_WITH_IMM: immediate verified");
        }
        with_imm = !iwarp;
        server_verified.count_down();

        // The client disconnects first: on rxe a server-first synchronous
        // rdma_disconnect was seen to block ~70 s waiting for the peer.
        client_disconnecting.wait();
        rdma_disconnect(id);
        rdma_dereg_mr(slots_mr);
        rdma_dereg_mr(region_mr);
        rdma_destroy_ep(id);
        say("server: done");
    });

    rdma_addrinfo* src = resolve(client_addr, nullptr, true, nullptr);
    rdma_addrinfo* cres = resolve(server_addr, port, false, src);
    rdma_cm_id* cid = nullptr;
    // Synchronous ep: this resolves address and route already.
    if (rdma_create_ep(&cid, cres, nullptr, &qa)) fail("rdma_create_ep(client, resolve %s -> %s): %s", client_addr, server_addr, std::strerror(errno));
    static std::array<char, kRegion> local{};
    ibv_mr* mr = ibv_reg_mr(cid->pd, local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
    if (!mr) fail("client ibv_reg_mr: %s (check `ulimit -l`)", std::strerror(errno));
    rdma_conn_param param{};
    param.responder_resources = 1;
    param.initiator_depth = 1;
    param.retry_count = 7;
    if (rdma_connect(cid, &param)) fail("rdma_connect: %s", std::strerror(errno));
    if (!cid->event || cid->event->param.conn.private_data_len < sizeof(RemoteBuf))
        fail("client: no remote buffer in the accept private data");
    RemoteBuf rb;
    std::memcpy(&rb, cid->event->param.conn.private_data, sizeof rb);
    const uint64_t raddr = be64toh(rb.addr_be);
    const uint32_t rkey = be32toh(rb.rkey_be);
    say("client: connected via %s, remote buffer 0x%llx rkey 0x%x len %u", ibv_get_device_name(cid->verbs->device),
        static_cast<unsigned long long>(raddr), rkey, be32toh(rb.len_be));
    const bool iwarp = cid->verbs->device->transport_type == IBV_TRANSPORT_IWARP;

    auto op = [&](ibv_wr_opcode opcode, size_t off, uint32_t len, uint64_t remote, const char* what,
                  uint32_t imm = 0) {
        ibv_sge sge{reinterpret_cast<uintptr_t>(local.data() + off), len, mr->lkey};
        ibv_send_wr wr{};
        wr.opcode = opcode;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.imm_data = htobe32(imm);
        wr.wr.rdma.remote_addr = remote;
        wr.wr.rdma.rkey = rkey;
        post_send(cid->qp, wr, what);
        wait_one(cid->send_cq, what);
        say("client: %s completed", what);
    };

    for (size_t i = 0; i < 256; ++i) local[i] = static_cast<char>(i ^ 0x5a);
    op(IBV_WR_RDMA_WRITE, 0, 256, raddr, "RDMA_WRITE");
    std::memcpy(local.data() + 1024, kHello.data(), kHello.size());
    op(IBV_WR_SEND, 1024, kHello.size(), 0, "SEND");

    std::memset(local.data() + 2048, 0, 256);
    op(IBV_WR_RDMA_READ, 2048, 256, raddr, "RDMA_READ");
    if (std::memcmp(local.data(), local.data() + 2048, 256) != 0) fail("client: RDMA_READ returned different data");
    pass("RDMA_READ data verified");

    if (!iwarp) {
        local[3072] = 'W';
        op(IBV_WR_RDMA_WRITE_WITH_IMM, 3072, 1, raddr + 512, "RDMA_WRITE_WITH_IMM", kImm);
        op(IBV_WR_SEND_WITH_IMM, 1024, kHello.size(), 0, "SEND_WITH_IMM", kImm + 1);
    } else {
        say("client: iWARP has no immediate data: WRITE_WITH_IMM/SEND_WITH_IMM skipped");
    }

    server_verified.wait();
    if (with_imm != !iwarp) fail("client and server disagree about the transport");
    client_disconnecting.count_down();
    rdma_disconnect(cid);
    server.join();
    rdma_dereg_mr(mr);
    rdma_destroy_ep(cid);
    rdma_destroy_ep(listen_id);
    rdma_freeaddrinfo(cres);
    rdma_freeaddrinfo(src);
    rdma_freeaddrinfo(sres);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    bool list_only = false;
    int pos = 1;
    if (pos < argc && std::string_view(argv[pos]) == "--list") {
        list_only = true;
        ++pos;
    }
    if (pos < argc && argv[pos][0] == '-') {
        std::fprintf(stderr, "usage: %s [--list] [SERVER_ADDR [CLIENT_ADDR [PORT]]]\n", argv[0]);
        return 2;
    }
    const char* server_addr = pos < argc ? argv[pos] : env_or("COVERBS_VM_ADDR_A", nullptr);
    const char* client_addr = pos + 1 < argc ? argv[pos + 1] : env_or("COVERBS_VM_ADDR_B", server_addr);
    const char* port = pos + 2 < argc ? argv[pos + 2] : env_or("VERBS_SMOKE_PORT", "7471");

    // Watchdog: rdma_cm calls can block for minutes when the fabric is broken.
    const unsigned timeout_s = static_cast<unsigned>(std::atoi(env_or("VERBS_SMOKE_TIMEOUT", "60")));
    signal(SIGALRM, [](int) {
        static constexpr char msg[] = "FAIL: verbs_smoke watchdog expired (VERBS_SMOKE_TIMEOUT)\n";
        (void)!write(STDOUT_FILENO, msg, sizeof msg - 1);
        _exit(1);
    });
    alarm(timeout_s);

    if (int rc = list_devices()) return rc;
    if (list_only) return 0;
    if (!server_addr) {
        std::printf("FAIL: no server address: pass one or set COVERBS_VM_ADDR_A (run-in-vm.sh does with VM_RDMA)\n");
        return 2;
    }
    loopback(server_addr, client_addr ? client_addr : server_addr, port);
    say("verbs_smoke: OK, %d checks passed", g_checks.load());
    return 0;
}
