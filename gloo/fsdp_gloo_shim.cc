// fsdp_gloo_shim.cc - the C API of fsdp_gloo_shim.h over Gloo's new-style
// collectives (TCP transport, FileStore rendezvous).
//
// Why not Gloo's ReduceScatterHalvingDoubling: on the Debian snapshot it
// leaves the context slow for every later large collective (a 64 MiB
// allgather goes from ~11 ms to ~19 s); fsdp_comm_gloo.h builds
// reduce-scatter from all_to_all plus a local sum instead.
#include "fsdp_gloo_shim.h"

#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

struct fsdp_gloo_ctx {
    std::shared_ptr<gloo::rendezvous::FileStore> store;
    std::shared_ptr<gloo::transport::Device> dev;
    std::shared_ptr<gloo::Context> ctx; // null when size == 1
    std::string prefix;
    int rank = 0, size = 1;
    unsigned splits = 0;
};

namespace {

std::chrono::milliseconds to_ms(int timeout_ms)
{
    // negative: "forever", which Gloo spells as a very long timeout
    return std::chrono::milliseconds(timeout_ms < 0 ? 24 * 3600 * 1000 : timeout_ms);
}

int fail(char *err, size_t cap, int code, const std::string &msg)
{
    if (err && cap) std::snprintf(err, cap, "%s", msg.c_str());
    return code;
}

// Gloo throws gloo::IoException for both timeouts and broken connections;
// only the message tells them apart.
int fail_exception(char *err, size_t cap, const char *what, const std::exception &e)
{
    std::string m = e.what();
    bool timeout = m.find("imed out") != std::string::npos ||
                   m.find("imeout") != std::string::npos;
    return fail(err, cap, timeout ? FSDP_GLOO_TIMEOUT : FSDP_GLOO_ERROR,
                std::string(what) + ": " + m);
}

bool has_key(gloo::rendezvous::Store &s, const std::string &key)
{
    try {
        s.wait({key}, std::chrono::milliseconds(1));
        return true;
    } catch (const std::exception &) {
        return false;
    }
}

int connect_ctx(fsdp_gloo_ctx *c, int timeout_ms)
{
    if (c->size == 1) return FSDP_GLOO_OK;
    gloo::rendezvous::PrefixStore ps(c->prefix + "/mesh", *c->store);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(c->rank, c->size);
    ctx->setTimeout(to_ms(timeout_ms));
    ctx->connectFullMesh(ps, c->dev);
    c->ctx = ctx;
    return FSDP_GLOO_OK;
}

} // namespace

extern "C" int fsdp_gloo_connect(const char *store_dir, const char *prefix, const char *host,
                                 int rank, int size, int timeout_ms, fsdp_gloo_ctx **out,
                                 char *err, size_t cap)
{
    if (!out) return fail(err, cap, FSDP_GLOO_ERROR, "fsdp_gloo_connect: out is NULL");
    *out = nullptr;
    if (!store_dir || !*store_dir)
        return fail(err, cap, FSDP_GLOO_ERROR, "fsdp_gloo_connect: no store directory");
    if (size < 1 || rank < 0 || rank >= size)
        return fail(err, cap, FSDP_GLOO_ERROR,
                    "fsdp_gloo_connect: rank " + std::to_string(rank) + " is not in [0, " +
                        std::to_string(size) + ")");
    try {
        std::unique_ptr<fsdp_gloo_ctx> c(new fsdp_gloo_ctx);
        c->rank = rank;
        c->size = size;
        c->prefix = prefix && *prefix ? prefix : "fsdp";
        c->store = std::make_shared<gloo::rendezvous::FileStore>(store_dir);
        gloo::transport::tcp::attr attr;
        attr.hostname = host && *host ? host : "127.0.0.1";
        c->dev = gloo::transport::tcp::CreateDevice(attr);
        // Our own arrival check before Gloo's: it names the missing ranks
        // and catches a different world size before anyone connects.
        gloo::rendezvous::PrefixStore ps(c->prefix + "/hello", *c->store);
        std::string mine = std::to_string(size);
        ps.set(std::to_string(rank), std::vector<char>(mine.begin(), mine.end()));
        auto deadline = std::chrono::steady_clock::now() + to_ms(timeout_ms);
        std::vector<int> missing;
        for (;;) {
            missing.clear();
            for (int k = 0; k < size; k++)
                if (k != rank && !has_key(ps, std::to_string(k))) missing.push_back(k);
            if (missing.empty() || std::chrono::steady_clock::now() > deadline) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        if (!missing.empty()) {
            std::string m = "fsdp_gloo_connect on rank " + std::to_string(rank) + ": rank";
            if (missing.size() > 1) m += "s";
            for (size_t i = 0; i < missing.size(); i++)
                m += (i ? ", " : " ") + std::to_string(missing[i]);
            m += " of " + std::to_string(size) + " did not arrive within " +
                 std::to_string(timeout_ms) + " ms (store " + store_dir + ", prefix " +
                 c->prefix + ")";
            return fail(err, cap, FSDP_GLOO_TIMEOUT, m);
        }
        for (int k = 0; k < size; k++) {
            std::vector<char> v = ps.get(std::to_string(k));
            std::string theirs(v.begin(), v.end());
            if (theirs != mine)
                return fail(err, cap, FSDP_GLOO_ERROR,
                            "fsdp_gloo_connect on rank " + std::to_string(rank) +
                                ": wrong world size: rank " + std::to_string(k) +
                                " was started with " + theirs + " ranks, this rank with " +
                                mine);
        }
        connect_ctx(c.get(), timeout_ms);
        *out = c.release();
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "fsdp_gloo_connect", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "fsdp_gloo_connect: unknown C++ exception");
    }
}

extern "C" int fsdp_gloo_rank(const fsdp_gloo_ctx *c) { return c ? c->rank : -1; }
extern "C" int fsdp_gloo_size(const fsdp_gloo_ctx *c) { return c ? c->size : 0; }

extern "C" int fsdp_gloo_all_gather(fsdp_gloo_ctx *c, const void *send, void *recv,
                                    size_t bytes, int timeout_ms, char *err, size_t cap)
{
    try {
        char *out = static_cast<char *>(recv);
        if (send && send != out + (size_t)c->rank * bytes)
            std::memcpy(out + (size_t)c->rank * bytes, send, bytes);
        if (c->size == 1 || bytes == 0) return FSDP_GLOO_OK;
        // no input buffer: Gloo then sends this rank's block of the output
        gloo::AllgatherOptions opts(c->ctx);
        opts.setOutput(out, bytes * (size_t)c->size);
        opts.setTimeout(to_ms(timeout_ms));
        gloo::allgather(opts);
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "gloo::allgather", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "gloo::allgather: unknown C++ exception");
    }
}

extern "C" int fsdp_gloo_all_to_all(fsdp_gloo_ctx *c, const void *send, void *recv,
                                    size_t bytes, int timeout_ms, char *err, size_t cap)
{
    try {
        if (c->size == 1) {
            if (send != recv) std::memmove(recv, send, bytes);
            return FSDP_GLOO_OK;
        }
        if (bytes == 0) return FSDP_GLOO_OK;
        gloo::AlltoallOptions opts(c->ctx);
        // Gloo's options take non-const pointers; it only reads the input
        opts.setInput(static_cast<char *>(const_cast<void *>(send)), bytes * (size_t)c->size);
        opts.setOutput(static_cast<char *>(recv), bytes * (size_t)c->size);
        opts.setTimeout(to_ms(timeout_ms));
        gloo::alltoall(opts);
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "gloo::alltoall", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "gloo::alltoall: unknown C++ exception");
    }
}

extern "C" int fsdp_gloo_all_to_all_chunked(fsdp_gloo_ctx *c, const void *send,
                                            void *const *recv_blocks, size_t bytes, size_t chunk,
                                            void (*done)(void *user, size_t off, size_t len),
                                            void *user, int timeout_ms, char *err, size_t cap)
{
    const char *in = static_cast<const char *>(send);
    size_t n = (size_t)c->size, r = (size_t)c->rank, nch, k, j;
    if (!chunk || chunk > bytes) chunk = bytes;
    nch = bytes ? (bytes + chunk - 1) / chunk : 0;
    try {
        if (n == 1) {
            for (k = 0; k < nch; k++) done(user, k * chunk, std::min(chunk, bytes - k * chunk));
            return FSDP_GLOO_OK;
        }
        // Point-to-point on unbound buffers, every chunk posted at once: the
        // transport's thread moves later chunks while done() sums earlier ones.
        uint64_t slot = (uint64_t)c->ctx->nextSlot();
        auto sbuf = c->ctx->createUnboundBuffer(const_cast<char *>(in), bytes * n);
        std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> rbuf(n);
        for (j = 0; j < n; j++)
            if (j != r) rbuf[j] = c->ctx->createUnboundBuffer(recv_blocks[j], bytes);
        for (k = 0; k < nch; k++)
            for (j = 0; j < n; j++)
                if (j != r) rbuf[j]->recv((int)j, slot, k * chunk, std::min(chunk, bytes - k * chunk));
        for (k = 0; k < nch; k++)
            for (size_t i = 1; i < n; i++) {
                size_t to = (r + i) % n; // start at our right neighbour: no hot spot
                sbuf->send((int)to, slot, to * bytes + k * chunk, std::min(chunk, bytes - k * chunk));
            }
        for (k = 0; k < nch; k++) {
            for (j = 0; j < n; j++) {
                int from = -1;
                if (j == r) continue;
                if (!rbuf[j]->waitRecv(&from, to_ms(timeout_ms)))
                    return fail(err, cap, FSDP_GLOO_TIMEOUT,
                                "alltoall: chunk " + std::to_string(k) + " from rank " +
                                    std::to_string(j) + " did not arrive within " +
                                    std::to_string(timeout_ms) + " ms");
            }
            done(user, k * chunk, std::min(chunk, bytes - k * chunk));
        }
        for (k = 0; k < nch * (n - 1); k++)
            if (!sbuf->waitSend(to_ms(timeout_ms)))
                return fail(err, cap, FSDP_GLOO_TIMEOUT, "alltoall: a send did not complete within " +
                                                             std::to_string(timeout_ms) + " ms");
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "alltoall (chunked)", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "alltoall (chunked): unknown C++ exception");
    }
}

extern "C" int fsdp_gloo_broadcast(fsdp_gloo_ctx *c, void *buf, size_t bytes, int root,
                                   int timeout_ms, char *err, size_t cap)
{
    try {
        if (c->size == 1 || bytes == 0) return FSDP_GLOO_OK;
        gloo::BroadcastOptions opts(c->ctx);
        opts.setOutput(static_cast<char *>(buf), bytes);
        opts.setRoot(root);
        opts.setTimeout(to_ms(timeout_ms));
        gloo::broadcast(opts);
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "gloo::broadcast", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "gloo::broadcast: unknown C++ exception");
    }
}

extern "C" int fsdp_gloo_barrier(fsdp_gloo_ctx *c, int timeout_ms, char *err, size_t cap)
{
    try {
        if (c->size == 1) return FSDP_GLOO_OK;
        gloo::BarrierOptions opts(c->ctx);
        opts.setTimeout(to_ms(timeout_ms));
        gloo::barrier(opts);
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "gloo::barrier", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "gloo::barrier: unknown C++ exception");
    }
}

extern "C" int fsdp_gloo_split(fsdp_gloo_ctx *c, int color, int key, int timeout_ms,
                               fsdp_gloo_ctx **out, char *err, size_t cap)
{
    *out = nullptr;
    try {
        // every rank learns every (color, key), then each group connects
        // through its own prefix of the same store
        std::vector<int> mine = {color, key}, all((size_t)c->size * 2);
        int r = fsdp_gloo_all_gather(c, mine.data(), all.data(), sizeof(int) * 2, timeout_ms, err,
                                     cap);
        if (r != FSDP_GLOO_OK) return r;
        unsigned n = c->splits++;
        if (color < 0) return FSDP_GLOO_OK;
        std::vector<std::pair<int, int>> members; // (key, rank)
        for (int j = 0; j < c->size; j++)
            if (all[2 * (size_t)j] == color) members.push_back({all[2 * (size_t)j + 1], j});
        std::sort(members.begin(), members.end());
        std::unique_ptr<fsdp_gloo_ctx> nc(new fsdp_gloo_ctx);
        nc->store = c->store;
        nc->dev = c->dev;
        nc->prefix = c->prefix + "/split" + std::to_string(n) + "/" + std::to_string(color);
        nc->size = (int)members.size();
        for (size_t i = 0; i < members.size(); i++)
            if (members[i].second == c->rank) nc->rank = (int)i;
        connect_ctx(nc.get(), timeout_ms);
        *out = nc.release();
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "fsdp_gloo_split", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "fsdp_gloo_split: unknown C++ exception");
    }
}

extern "C" void fsdp_gloo_free(fsdp_gloo_ctx *c)
{
    try {
        delete c;
    } catch (...) {
        // a destructor that throws has nothing left to tell anyone
    }
}
