// hostile_client's rdma_cm modes (verbs provider; run inside the VM). See
// hostile_client.cc for what each mode does.
#include <arpa/inet.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/hostile/hostile.h"

namespace hostile {
namespace {

// One connection attempt with its own event channel, driven synchronously.
struct Conn {
  rdma_event_channel* ch = nullptr;
  rdma_cm_id* id = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_mr* mr = nullptr;
  std::vector<char> buf;
  bool has_qp = false;

  ~Conn() {
    if (has_qp) rdma_destroy_qp(id);
    if (mr) ibv_dereg_mr(mr);
    if (cq) ibv_destroy_cq(cq);
    if (pd) ibv_dealloc_pd(pd);
    if (id) rdma_destroy_id(id);
    if (ch) rdma_destroy_event_channel(ch);
  }

  // The next event's type (acked), or -1 on timeout / error.
  int Next(int timeout_ms, std::string* detail = nullptr) {
    pollfd p{ch->fd, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) return -1;
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(ch, &ev) != 0) return -1;
    int type = ev->event;
    if (detail != nullptr && type == RDMA_CM_EVENT_REJECTED &&
        ev->param.conn.private_data_len > 6) {
      // coverbs reject: u32 "CVBR", u16 length, reason.
      const char* pd = static_cast<const char*>(ev->param.conn.private_data);
      uint16_t len;
      std::memcpy(&len, pd + 4, 2);
      size_t avail = ev->param.conn.private_data_len - 6;
      *detail = std::string(pd + 6, std::min<size_t>(len, avail));
    }
    rdma_ack_cm_event(ev);
    return type;
  }

  // Resolves and connects with `private_data`; returns the event that ended
  // the attempt (ESTABLISHED, REJECTED, ...) or -1.
  int Connect(const Options& o, const std::string& private_data,
              std::string* detail) {
    ch = rdma_create_event_channel();
    if (ch == nullptr || rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0)
      return -1;
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(o.port);
    inet_pton(AF_INET, o.address.c_str(), &sa.sin_addr);
    if (rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&sa),
                          2000) != 0 ||
        Next(3000) != RDMA_CM_EVENT_ADDR_RESOLVED) {
      return -1;
    }
    if (rdma_resolve_route(id, 2000) != 0 ||
        Next(3000) != RDMA_CM_EVENT_ROUTE_RESOLVED) {
      return -1;
    }
    pd = ibv_alloc_pd(id->verbs);
    cq = pd ? ibv_create_cq(id->verbs, 64, nullptr, nullptr, 0) : nullptr;
    if (cq == nullptr) return -1;
    ibv_qp_init_attr qa{};
    qa.send_cq = qa.recv_cq = cq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = 16;
    qa.cap.max_recv_wr = 32;
    qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
    if (rdma_create_qp(id, pd, &qa) != 0) return -1;
    has_qp = true;
    // Receives for what the handshake promises (4 credits + reserves), so
    // a server that sends does not meet RNR from us.
    buf.resize(16 * 8208);
    mr = ibv_reg_mr(pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE);
    if (mr == nullptr) return -1;
    for (int i = 0; i < 16; ++i) {
      ibv_sge sge{reinterpret_cast<uint64_t>(buf.data() + i * 8208), 8208,
                  mr->lkey};
      ibv_recv_wr wr{}, *bad = nullptr;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      if (ibv_post_recv(id->qp, &wr, &bad) != 0) return -1;
    }
    rdma_conn_param p{};
    p.private_data = private_data.data();
    p.private_data_len = static_cast<uint8_t>(private_data.size());
    p.responder_resources = p.initiator_depth = 1;
    p.retry_count = 7;
    p.rnr_retry_count = 7;
    if (rdma_connect(id, &p) != 0) return -1;
    return Next(5000, detail);
  }
};

const char* EventName(int type) {
  return type < 0 ? "no answer within 5 s"
                  : rdma_event_str(static_cast<rdma_cm_event_type>(type));
}

}  // namespace

int RunRdmaCm(const Options& o) {
  std::mt19937_64 rng(o.seed);
  std::map<std::string, int> outcome;
  std::vector<std::unique_ptr<Conn>> held;
  if (o.mode == "cm_many_exit") {
    // Every request in flight at once, then exit with all of them open: the
    // server must clean up after a peer that vanished mid-handshake or
    // right after it.
    std::vector<std::unique_ptr<Conn>> conns;
    for (int i = 0; i < o.count; ++i) {
      auto c = std::make_unique<Conn>();
      std::string detail;
      int ev = c->Connect(o, ValidHandshake(), &detail);
      outcome[EventName(ev)]++;
      conns.push_back(std::move(c));
    }
    for (const auto& [what, n] : outcome)
      std::printf("  %5d  %s\n", n, what.c_str());
    std::printf("hostile_client: exiting with %d connections open\n", o.count);
    std::fflush(stdout);
    _exit(0);
  }
  for (int i = 0; i < o.count; ++i) {
    auto c = std::make_unique<Conn>();
    std::string pdata;
    if (o.mode == "cm_random") {
      pdata.resize(1 + rng() % 56);
      for (char& ch : pdata) ch = static_cast<char>(rng());
    } else if (o.mode == "cm_silent" || o.mode == "cm_disconnect") {
      pdata = ValidHandshake();
    } else {
      std::fprintf(stderr, "hostile_client: unknown --mode=%s\n",
                   o.mode.c_str());
      return 2;
    }
    std::string detail;
    int ev = c->Connect(o, pdata, &detail);
    std::string what = EventName(ev);
    if (!detail.empty()) what += ": " + detail;
    outcome[what]++;
    if (ev != RDMA_CM_EVENT_ESTABLISHED) continue;
    if (o.mode == "cm_disconnect") {
      rdma_disconnect(c->id);
      int e = c->Next(5000);
      outcome[std::string("after our disconnect: ") + EventName(e)]++;
    } else if (o.mode == "cm_silent") {
      held.push_back(std::move(c));
    }
  }
  if (!held.empty()) {
    // Hold; count the connections the server ended (DISCONNECTED) meanwhile.
    auto until = std::chrono::steady_clock::now() + o.hold;
    std::vector<bool> down(held.size(), false);
    while (std::chrono::steady_clock::now() < until) {
      for (size_t i = 0; i < held.size(); ++i) {
        if (!down[i] && held[i]->Next(0) == RDMA_CM_EVENT_DISCONNECTED)
          down[i] = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    int n = 0;
    for (bool d : down) n += d;
    outcome["disconnected by the server during the hold"] += n;
    outcome["still connected at the end of the hold"] +=
        static_cast<int>(held.size()) - n;
    for (auto& c : held) rdma_disconnect(c->id);
  }
  for (const auto& [what, n] : outcome)
    std::printf("  %5d  %s\n", n, what.c_str());
  return 0;
}

}  // namespace hostile
