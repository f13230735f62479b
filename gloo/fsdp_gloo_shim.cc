// fsdp_gloo_shim.cc - the C API of fsdp_gloo_shim.h: Gloo's TCP device
// chooses this rank's address (interface, host, the host name's), and the
// rest is ours: rendezvous stores (a directory, or a small TCP store served
// by rank 0), a full mesh of plain TCP connections, and collectives that
// move the bytes on the calling thread over those connections.
//
// Why our own stores: Gloo's FileStore cannot tell two jobs apart, refuses
// a reused directory with an internal "File already exists", and Debian's
// snapshot has no TCP store. Why our own mesh connect: Gloo's waits 5x the
// timeout for the first connection and does not say which rank it waited
// for. Why our own data path: Gloo's pairs read every message on the
// device's thread, wake the caller through a condition variable, and
// announce each unbound buffer to the peer before its bytes may travel; on
// 2 cores those threads fight the ranks' and train_gpt took 3-10x its MPI
// time (now about 1x). Why point-to-point collectives: a timeout names the
// rank whose data did not come. Why not Gloo's ReduceScatterHalvingDoubling:
// on the Debian snapshot it leaves the context slow for every later large
// collective (a 64 MiB allgather goes from ~11 ms to ~19 s);
// fsdp_comm_gloo.h builds reduce-scatter from all_to_all plus a local sum.
#include "fsdp_gloo_shim.h"

#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// A failure with its shim result code; every entry point turns it into
// (code, message).
struct Failure : std::runtime_error {
    int code;
    Failure(int c, const std::string &m) : std::runtime_error(m), code(c) {}
};

std::chrono::milliseconds to_ms(int timeout_ms)
{
    // negative: "forever", which Gloo spells as a very long timeout
    return std::chrono::milliseconds(timeout_ms < 0 ? 24 * 3600 * 1000 : timeout_ms);
}

struct Deadline {
    Clock::time_point at;
    bool forever;
    explicit Deadline(int timeout_ms)
        : at(Clock::now() + to_ms(timeout_ms)), forever(timeout_ms < 0) {}
    bool passed() const { return !forever && Clock::now() >= at; }
    std::chrono::milliseconds left() const
    {
        if (forever) return to_ms(-1);
        auto l = std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now());
        return l.count() > 0 ? l : std::chrono::milliseconds(0);
    }
};

int fail(char *err, size_t cap, int code, const std::string &msg)
{
    if (err && cap) std::snprintf(err, cap, "%s", msg.c_str());
    return code;
}

// Gloo throws gloo::IoException for both timeouts and broken connections;
// only the message tells them apart.
int fail_exception(char *err, size_t cap, const char *what, const std::exception &e)
{
    if (auto f = dynamic_cast<const Failure *>(&e)) return fail(err, cap, f->code, f->what());
    std::string m = e.what();
    bool timeout = m.find("imed out") != std::string::npos ||
                   m.find("imeout") != std::string::npos;
    return fail(err, cap, timeout ? FSDP_GLOO_TIMEOUT : FSDP_GLOO_ERROR,
                std::string(what) + ": " + m);
}

std::string str(int v) { return std::to_string(v); }

std::string rank_list(const std::vector<int> &ranks)
{
    std::string m = ranks.size() > 1 ? "ranks" : "rank";
    for (size_t i = 0; i < ranks.size(); i++) m += (i ? ", " : " ") + str(ranks[i]);
    return m;
}

std::string this_host()
{
    char h[256] = {0};
    if (gethostname(h, sizeof h - 1) != 0) return "unknown";
    return h;
}

std::string fresh_id()
{
    std::random_device rd;
    uint64_t v = ((uint64_t)rd() << 32) ^ rd() ^ ((uint64_t)getpid() << 16) ^
                 (uint64_t)Clock::now().time_since_epoch().count();
    char b[32];
    std::snprintf(b, sizeof b, "%016llx", (unsigned long long)v);
    return b;
}

// "k=v" lines
std::map<std::string, std::string> parse_kv(const std::string &s)
{
    std::map<std::string, std::string> m;
    size_t i = 0;
    while (i < s.size()) {
        size_t e = s.find('\n', i);
        if (e == std::string::npos) e = s.size();
        std::string line = s.substr(i, e - i);
        size_t eq = line.find('=');
        if (eq != std::string::npos) m[line.substr(0, eq)] = line.substr(eq + 1);
        i = e + 1;
    }
    return m;
}

// ---------------------------------------------------------------- stores

// What the rendezvous needs of a store: plain set/get, an exclusive create
// (the job record and each rank's claim), removal, and for the directory
// store the age of the job record's heartbeat.
struct KV {
    virtual ~KV() {}
    virtual void set(const std::string &k, const std::string &v) = 0;
    virtual bool create(const std::string &k, const std::string &v) = 0; // false: exists
    virtual bool get(const std::string &k, std::string *v) = 0;          // false: missing
    virtual void remove(const std::string &k) = 0;                       // k and k/...
    // milliseconds since rank 0 last touched k; < 0 unknown
    virtual long age_ms(const std::string &) { return -1; }
    virtual void touch(const std::string &) {}
    // true when the store itself proves that the job owning it is alive
    virtual bool owner_alive() const { return false; }
    virtual void cleanup_prefix(const std::string &) {}
    virtual std::string where() const = 0;
};

// Keys are files under a directory every rank sees: "a/b" is dir/a/b.
// create is link(2) of a complete temporary file: exclusive, never half
// written, also on NFS.
struct DirStore : KV {
    std::string dir;
    std::atomic<unsigned> seq{0};
    explicit DirStore(const std::string &d) : dir(d)
    {
        struct stat st;
        if (stat(d.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
            throw Failure(FSDP_GLOO_INVALID, "store directory " + d +
                                                 " does not exist (or is not a directory): "
                                                 "create it first, on a file system every rank sees");
    }
    std::string path(const std::string &k) const { return dir + "/" + k; }
    void mkparents(const std::string &p)
    {
        for (size_t i = dir.size() + 1; i < p.size(); i++)
            if (p[i] == '/') {
                std::string d = p.substr(0, i);
                if (mkdir(d.c_str(), 0777) != 0 && errno != EEXIST)
                    throw Failure(FSDP_GLOO_ERROR, "cannot create " + d + ": " + strerror(errno));
            }
    }
    std::string write_tmp(const std::string &k, const std::string &v)
    {
        std::string p = path(k);
        mkparents(p);
        std::string tmp = p + ".tmp." + str((int)getpid()) + "." + str((int)seq++);
        int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
        if (fd < 0) throw Failure(FSDP_GLOO_ERROR, "cannot write " + tmp + ": " + strerror(errno));
        size_t off = 0;
        while (off < v.size()) {
            ssize_t w = write(fd, v.data() + off, v.size() - off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                int e = errno;
                close(fd);
                unlink(tmp.c_str());
                throw Failure(FSDP_GLOO_ERROR, "cannot write " + tmp + ": " + strerror(e));
            }
            off += (size_t)w;
        }
        close(fd);
        return tmp;
    }
    void set(const std::string &k, const std::string &v) override
    {
        std::string tmp = write_tmp(k, v);
        if (rename(tmp.c_str(), path(k).c_str()) != 0) {
            int e = errno;
            unlink(tmp.c_str());
            throw Failure(FSDP_GLOO_ERROR, "cannot write " + path(k) + ": " + strerror(e));
        }
    }
    bool create(const std::string &k, const std::string &v) override
    {
        std::string tmp = write_tmp(k, v);
        int rc = link(tmp.c_str(), path(k).c_str()), e = errno;
        unlink(tmp.c_str());
        if (rc == 0) return true;
        if (e == EEXIST) return false;
        throw Failure(FSDP_GLOO_ERROR, "cannot create " + path(k) + ": " + strerror(e));
    }
    bool get(const std::string &k, std::string *v) override
    {
        int fd = open(path(k).c_str(), O_RDONLY);
        if (fd < 0) {
            if (errno == ENOENT || errno == ENOTDIR) return false;
            throw Failure(FSDP_GLOO_ERROR, "cannot read " + path(k) + ": " + strerror(errno));
        }
        v->clear();
        char b[4096];
        for (;;) {
            ssize_t r = read(fd, b, sizeof b);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            v->append(b, (size_t)r);
        }
        close(fd);
        return true;
    }
    static void rm_tree(const std::string &p)
    {
        struct stat st;
        if (lstat(p.c_str(), &st) != 0) return;
        if (S_ISDIR(st.st_mode)) {
            DIR *d = opendir(p.c_str());
            if (d) {
                std::vector<std::string> names;
                while (struct dirent *e = readdir(d))
                    if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
                        names.push_back(e->d_name);
                closedir(d);
                for (auto &n : names) rm_tree(p + "/" + n);
            }
            rmdir(p.c_str());
        } else {
            unlink(p.c_str());
        }
    }
    void remove(const std::string &k) override { rm_tree(path(k)); }
    long age_ms(const std::string &k) override
    {
        // compare with a file written now on the same file system: the
        // server's clock on both, whatever this host's clock says
        struct stat rec, now;
        std::string probe = path(k) + ".probe." + this_host() + "." + str((int)getpid());
        if (stat(path(k).c_str(), &rec) != 0) return -1;
        int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
        if (fd < 0) return -1;
        close(fd);
        int rc = stat(probe.c_str(), &now);
        unlink(probe.c_str());
        if (rc != 0) return -1;
        long ms = (long)(now.st_mtim.tv_sec - rec.st_mtim.tv_sec) * 1000 +
                  (long)(now.st_mtim.tv_nsec - rec.st_mtim.tv_nsec) / 1000000;
        return ms < 0 ? 0 : ms;
    }
    void touch(const std::string &k) override { utimensat(AT_FDCWD, path(k).c_str(), nullptr, 0); }
    void cleanup_prefix(const std::string &prefix) override
    {
        // the prefix's directories, when nothing else is left in them
        std::string p = path(prefix);
        while (p.size() > dir.size() && rmdir(p.c_str()) == 0) {
            size_t s = p.rfind('/');
            if (s == std::string::npos || s <= dir.size()) break;
            p = p.substr(0, s);
        }
    }
    std::string where() const override { return "store directory " + dir; }
};

// The TCP store: a map in rank 0, served on master_addr:master_port by a
// thread; every rank (rank 0 too) talks to it over one connection.
// Messages: op (1 byte), key length (4), key, value length (4), value;
// replies: status (1), value length (4), value. A greeting first, so that
// another program on the port is named as such.
const char kGreeting[8] = {'F', 'S', 'D', 'P', 'K', 'V', '1', '\n'};

bool write_all(int fd, const void *p, size_t n)
{
    const char *c = static_cast<const char *>(p);
    while (n) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        c += w;
        n -= (size_t)w;
    }
    return true;
}

bool read_all(int fd, void *p, size_t n)
{
    char *c = static_cast<char *>(p);
    while (n) {
        ssize_t r = recv(fd, c, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        c += r;
        n -= (size_t)r;
    }
    return true;
}

bool read_str(int fd, std::string *s)
{
    uint32_t n;
    if (!read_all(fd, &n, 4)) return false;
    n = ntohl(n);
    if (n > (64u << 20)) return false;
    s->resize(n);
    return n == 0 || read_all(fd, &(*s)[0], n);
}

bool write_str(int fd, const std::string &s)
{
    uint32_t n = htonl((uint32_t)s.size());
    return write_all(fd, &n, 4) && write_all(fd, s.data(), s.size());
}

struct TcpServer {
    int lfd = -1, wake[2] = {-1, -1};
    std::thread th;
    std::map<std::string, std::string> kv;

    ~TcpServer() { stop(); }
    void stop()
    {
        if (th.joinable()) {
            char c = 0;
            if (write(wake[1], &c, 1) < 0) {
                // the thread also wakes every 200 ms on its own
            }
            th.join();
        }
        if (lfd >= 0) close(lfd);
        if (wake[0] >= 0) close(wake[0]);
        if (wake[1] >= 0) close(wake[1]);
        lfd = wake[0] = wake[1] = -1;
    }
    void start(const std::string &addr, int port)
    {
        lfd = socket(AF_INET6, SOCK_STREAM, 0);
        bool v6 = lfd >= 0;
        if (!v6) lfd = socket(AF_INET, SOCK_STREAM, 0);
        if (lfd < 0) throw Failure(FSDP_GLOO_ERROR, std::string("socket: ") + strerror(errno));
        int one = 1, zero = 0;
        setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        int rc;
        if (v6) {
            // every address of this host, IPv4 too, as torch's TCPStore
            setsockopt(lfd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
            struct sockaddr_in6 a;
            memset(&a, 0, sizeof a);
            a.sin6_family = AF_INET6;
            a.sin6_addr = in6addr_any;
            a.sin6_port = htons((uint16_t)port);
            rc = bind(lfd, (struct sockaddr *)&a, sizeof a);
        } else {
            struct sockaddr_in a;
            memset(&a, 0, sizeof a);
            a.sin_family = AF_INET;
            a.sin_addr.s_addr = htonl(INADDR_ANY);
            a.sin_port = htons((uint16_t)port);
            rc = bind(lfd, (struct sockaddr *)&a, sizeof a);
        }
        if (rc != 0 || listen(lfd, 128) != 0) {
            int e = errno;
            throw Failure(e == EADDRINUSE ? FSDP_GLOO_INVALID : FSDP_GLOO_ERROR,
                          "rank 0 cannot serve the TCP store on port " + str(port) + " (" +
                              addr + ":" + str(port) + "): " + strerror(e) +
                              (e == EADDRINUSE ? "; another job (or program) uses that port: "
                                                 "give this job another port (master_port, "
                                                 "MASTER_PORT, --master HOST:PORT)"
                                               : ""));
        }
        if (pipe(wake) != 0) throw Failure(FSDP_GLOO_ERROR, std::string("pipe: ") + strerror(errno));
        th = std::thread([this] { loop(); });
    }
    bool serve(int fd)
    {
        unsigned char op;
        std::string k, v, out;
        if (!read_all(fd, &op, 1) || !read_str(fd, &k) || !read_str(fd, &v)) return false;
        unsigned char st = 0;
        if (op == 'S') {
            kv[k] = v;
        } else if (op == 'C') {
            auto it = kv.find(k);
            if (it == kv.end()) kv[k] = v;
            else st = 1;
        } else if (op == 'G') {
            auto it = kv.find(k);
            if (it == kv.end()) st = 1;
            else out = it->second;
        } else if (op == 'D') {
            for (auto it = kv.begin(); it != kv.end();)
                if (it->first == k || it->first.compare(0, k.size() + 1, k + "/") == 0)
                    it = kv.erase(it);
                else ++it;
        } else {
            return false;
        }
        return write_all(fd, &st, 1) && write_str(fd, out);
    }
    void loop()
    {
        std::vector<int> clients;
        std::vector<bool> greeted;
        for (;;) {
            std::vector<struct pollfd> p;
            p.push_back({wake[0], POLLIN, 0});
            p.push_back({lfd, POLLIN, 0});
            for (int c : clients) p.push_back({c, POLLIN, 0});
            if (poll(p.data(), p.size(), 200) < 0 && errno != EINTR) break;
            if (p[0].revents) break;
            if (p[1].revents & POLLIN) {
                int c = accept(lfd, nullptr, nullptr);
                if (c >= 0) {
                    // a client that stalls mid-message does not stall the others for long
                    struct timeval tv = {2, 0};
                    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
                    int one = 1;
                    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    clients.push_back(c);
                    greeted.push_back(false);
                }
            }
            for (size_t i = 2; i < p.size(); i++) {
                size_t ci = i - 2;
                if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
                bool ok;
                if (!greeted[ci]) {
                    char g[8];
                    ok = read_all(clients[ci], g, 8) && !memcmp(g, kGreeting, 8) &&
                         write_all(clients[ci], kGreeting, 8);
                    greeted[ci] = ok;
                } else {
                    ok = serve(clients[ci]);
                }
                if (!ok) {
                    close(clients[ci]);
                    clients[ci] = -1;
                }
            }
            for (size_t i = clients.size(); i-- > 0;)
                if (clients[i] < 0) {
                    clients.erase(clients.begin() + (long)i);
                    greeted.erase(greeted.begin() + (long)i);
                }
        }
        for (int c : clients) close(c);
    }
};

struct TcpStore : KV {
    std::string addr;
    int port;
    int fd = -1;
    std::unique_ptr<TcpServer> server; // rank 0's
    std::mutex mu;

    int timeout_ms;
    TcpStore(const std::string &a, int p, int rank, const Deadline &dl, int t)
        : addr(a), port(p), timeout_ms(t)
    {
        if (rank == 0) {
            server.reset(new TcpServer);
            server->start(a, p);
        }
        connect_to(rank, dl);
    }
    ~TcpStore() override
    {
        if (fd >= 0) close(fd);
        server.reset();
    }
    void connect_to(int rank, const Deadline &dl)
    {
        std::string last = "no attempt";
        for (;;) {
            struct addrinfo hints, *res = nullptr;
            memset(&hints, 0, sizeof hints);
            hints.ai_family = AF_UNSPEC;
            hints.ai_socktype = SOCK_STREAM;
            int g = getaddrinfo(addr.c_str(), str(port).c_str(), &hints, &res);
            if (g != 0) {
                last = std::string("cannot resolve ") + addr + ": " + gai_strerror(g);
            } else {
                for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
                    int s = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
                    if (s < 0) continue;
                    if (::connect(s, ai->ai_addr, ai->ai_addrlen) == 0) {
                        char g8[8];
                        // a store that stops answering fails a call within the timeout
                        struct timeval tv = {0, 0};
                        if (!dl.forever) {
                            long ms = std::max(1000L, (long)timeout_ms);
                            tv.tv_sec = ms / 1000;
                            tv.tv_usec = (ms % 1000) * 1000;
                        }
                        setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
                        int one = 1;
                        setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                        if (write_all(s, kGreeting, 8) && read_all(s, g8, 8) &&
                            !memcmp(g8, kGreeting, 8)) {
                            fd = s;
                            freeaddrinfo(res);
                            return;
                        }
                        close(s);
                        freeaddrinfo(res);
                        throw Failure(FSDP_GLOO_INVALID,
                                      "fsdp_gloo_connect on rank " + str(rank) + ": " + addr + ":" + str(port) +
                                          " answers, but is not an fsdp.h Gloo store (another "
                                          "program, or another job's rank 0 is still greeting): "
                                          "give this job another port (master_port, MASTER_PORT, "
                                          "--master HOST:PORT)");
                    }
                    last = std::string(strerror(errno));
                    close(s);
                }
                freeaddrinfo(res);
            }
            if (dl.passed())
                throw Failure(FSDP_GLOO_TIMEOUT,
                              "fsdp_gloo_connect on rank " + str(rank) + ": no TCP store at " + addr + ":" + str(port) +
                                  " within the timeout (last attempt: " + last +
                                  "): rank 0 was not started, has failed, or master_addr does "
                                  "not name rank 0's host as this host reaches it");
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }
    bool call(char op, const std::string &k, const std::string &v, std::string *out)
    {
        std::lock_guard<std::mutex> g(mu);
        unsigned char o = (unsigned char)op, st = 0;
        std::string r;
        if (fd < 0 || !write_all(fd, &o, 1) || !write_str(fd, k) || !write_str(fd, v) ||
            !read_all(fd, &st, 1) || !read_str(fd, &r))
            throw Failure(FSDP_GLOO_ERROR, "the TCP store at " + addr + ":" + str(port) +
                                               " stopped answering (rank 0 gone?)");
        if (out) *out = r;
        return st == 0;
    }
    void set(const std::string &k, const std::string &v) override { call('S', k, v, nullptr); }
    bool create(const std::string &k, const std::string &v) override
    {
        return call('C', k, v, nullptr);
    }
    bool get(const std::string &k, std::string *v) override { return call('G', k, "", v); }
    void remove(const std::string &k) override { call('D', k, "", nullptr); }
    bool owner_alive() const override { return true; }
    std::string where() const override { return "TCP store " + addr + ":" + str(port); }
};

// ---------------------------------------------------------------- addresses

// The address this rank listens on, chosen as torch's Gloo process group
// does: an interface (ifname / GLOO_SOCKET_IFNAME), else the given host,
// else the address the host name resolves to, if this machine can listen on
// it, else the loopback address.
std::shared_ptr<gloo::transport::Device> make_device(const fsdp_gloo_opts *o, std::string *how,
                                                     struct sockaddr_storage *ss)
{
    gloo::transport::tcp::attr attr;
    const char *env = getenv("GLOO_SOCKET_IFNAME");
    std::string hint = "choose this rank's address with host (--host ADDR) or its network "
                       "interface with GLOO_SOCKET_IFNAME=NAME (or ifname)";
    if (o->ifname && *o->ifname) {
        attr.iface = o->ifname;
        *how = "interface " + attr.iface + " (ifname)";
    } else if (env && *env) {
        attr.iface = env;
        *how = "interface " + attr.iface + " (GLOO_SOCKET_IFNAME)";
    } else if (o->host && *o->host && strcmp(o->host, "0.0.0.0") != 0) {
        attr.hostname = o->host;
        *how = std::string("address ") + o->host + " (host)";
    } else {
        std::string h = this_host(), found;
        struct addrinfo hints, *res = nullptr;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        if (getaddrinfo(h.c_str(), nullptr, &hints, &res) == 0) {
            for (struct addrinfo *ai = res; ai && found.empty(); ai = ai->ai_next) {
                int s = socket(ai->ai_family, SOCK_STREAM, 0);
                if (s < 0) continue;
                if (bind(s, ai->ai_addr, ai->ai_addrlen) == 0) {
                    char nb[NI_MAXHOST];
                    if (getnameinfo(ai->ai_addr, ai->ai_addrlen, nb, sizeof nb, nullptr, 0,
                                    NI_NUMERICHOST) == 0)
                        found = nb;
                }
                close(s);
            }
            freeaddrinfo(res);
        }
        if (!found.empty()) {
            attr.hostname = found;
            *how = "address " + found + " (of the host name " + h + ")";
        } else {
            attr.hostname = "127.0.0.1";
            *how = "address 127.0.0.1 (loopback: the host name " + h +
                   " has no address this machine can listen on)";
        }
    }
    // Check first what Gloo would throw on: its throwing paths leak (the
    // Debian snapshot does not free getaddrinfo's / getifaddrs' lists there)
    if (!attr.iface.empty()) {
        struct ifaddrs *ifs = nullptr;
        bool found = false;
        if (getifaddrs(&ifs) == 0) {
            for (struct ifaddrs *i = ifs; i; i = i->ifa_next)
                if (i->ifa_addr && attr.iface == i->ifa_name &&
                    (i->ifa_addr->sa_family == AF_INET || i->ifa_addr->sa_family == AF_INET6))
                    found = true;
            freeifaddrs(ifs);
        }
        if (!found)
            throw Failure(FSDP_GLOO_INVALID, "fsdp_gloo_connect: cannot listen on " + *how +
                                                 ": no such interface with an IP address "
                                                 "(see ip -br addr); " + hint);
    } else {
        struct addrinfo hints, *res = nullptr;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        int g = getaddrinfo(attr.hostname.c_str(), nullptr, &hints, &res);
        if (g != 0)
            throw Failure(FSDP_GLOO_INVALID, "fsdp_gloo_connect: cannot listen on " + *how +
                                                 ": cannot resolve it (" + gai_strerror(g) +
                                                 "); " + hint);
        std::string why = "no address";
        bool ok = false;
        for (struct addrinfo *ai = res; ai && !ok; ai = ai->ai_next) {
            int fd = socket(ai->ai_family, SOCK_STREAM, 0);
            if (fd < 0) continue;
            if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0) ok = true;
            else why = strerror(errno);
            close(fd);
        }
        freeaddrinfo(res);
        if (!ok)
            throw Failure(FSDP_GLOO_INVALID, "fsdp_gloo_connect: cannot listen on " + *how +
                                                 ": " + why + " (not an address of this "
                                                 "machine?); " + hint);
    }
    try {
        // the address Gloo chose: the data connections listen there too
        *ss = gloo::transport::tcp::CreateDeviceAttr(attr).ai_addr;
        return gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception &e) {
        throw Failure(FSDP_GLOO_INVALID, "fsdp_gloo_connect: cannot listen on " + *how + ": " + e.what() + "; " + hint);
    }
}

// a is Gloo's "[ADDR]" or "[ADDR]:PORT", or a bare address
bool is_loopback(const std::string &a)
{
    std::string h = a;
    if (!h.empty() && h[0] == '[') h = h.substr(1, h.find(']') == std::string::npos
                                                       ? std::string::npos
                                                       : h.find(']') - 1);
    return h.compare(0, 4, "127.") == 0 || h == "::1" || h == "::ffff:127.0.0.1";
}

// ---------------------------------------------------------------- the mesh

} // namespace

struct fsdp_gloo_ctx {
    std::shared_ptr<KV> store;
    std::shared_ptr<gloo::transport::Device> dev;
    // the data path: one TCP connection per peer (-1: none, this rank)
    std::vector<int> fds;
    struct sockaddr_storage laddr{}; // this rank's address (port 0)
    uint64_t calls = 0;            // collectives so far, the same count on every rank
    uint64_t key = 0;              // fsdp_gloo_set_check
    int (*peer_ok)(void *, int) = nullptr;
    void *peer_user = nullptr;
    std::string prefix;        // the user's prefix
    std::string keys;          // this context's keys: prefix/job id[/split...]
    std::string job, record, address;
    std::vector<std::string> peers; // each rank's address and host, for messages
    int rank = 0, size = 1;
    unsigned splits = 0;
    bool owner = false; // rank 0 of the world: ends the job at free
    // rank 0's heartbeat on a directory store's job record
    std::thread beat;
    std::mutex beat_mu;
    std::condition_variable beat_cv;
    bool beat_stop = false;

    ~fsdp_gloo_ctx()
    {
        if (beat.joinable()) {
            {
                std::lock_guard<std::mutex> g(beat_mu);
                beat_stop = true;
            }
            beat_cv.notify_all();
            beat.join();
        }
        for (int fd : fds)
            if (fd >= 0) close(fd);
        if (owner && store) {
            try {
                std::string cur;
                store->remove(keys);
                if (store->get(prefix + "/job", &cur) && cur == record) store->remove(prefix + "/job");
                store->cleanup_prefix(prefix);
            } catch (...) {
                // a store that cannot be cleaned only leaves files behind
            }
        }
    }
};

namespace {

std::string peer(const fsdp_gloo_ctx *c, int j)
{
    std::string m = "rank " + str(j);
    if (j >= 0 && (size_t)j < c->peers.size() && !c->peers[(size_t)j].empty())
        m += " (" + c->peers[(size_t)j] + ")";
    return m;
}

// A socket closed at scope exit unless released.
struct Sock {
    int fd = -1;
    Sock() {}
    explicit Sock(int f) : fd(f) {}
    Sock(const Sock &) = delete;
    Sock &operator=(const Sock &) = delete;
    ~Sock()
    {
        if (fd >= 0) close(fd);
    }
    int release()
    {
        int f = fd;
        fd = -1;
        return f;
    }
};

// Waits until fd is ready for events or dl passes (false).
bool wait_fd(int fd, short events, const Deadline &dl)
{
    for (;;) {
        struct pollfd p = {fd, events, 0};
        long ms = dl.forever ? -1 : (long)dl.left().count();
        int rc = poll(&p, 1, ms > INT32_MAX ? INT32_MAX : (int)ms);
        if (rc > 0) return true;
        if (rc < 0 && errno != EINTR) return true; // the caller's I/O reports it
        if (rc == 0 && dl.passed()) return false;
    }
}

// Reads or writes n bytes on a nonblocking socket within dl: 1 done, 0 the
// deadline passed, -1 the connection failed or closed (errno; 0: closed).
int io_all(int fd, void *p, size_t n, bool out, const Deadline &dl)
{
    char *b = static_cast<char *>(p);
    while (n) {
        ssize_t k = out ? send(fd, b, n, MSG_NOSIGNAL) : recv(fd, b, n, 0);
        if (k > 0) {
            b += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0 && !out) {
            errno = 0;
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
        if (!wait_fd(fd, out ? POLLOUT : POLLIN, dl)) return 0;
    }
    return 1;
}

void data_socket(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

socklen_t sa_len(const struct sockaddr_storage &a)
{
    return a.ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
}

// What a connecting rank says first, and the one byte its peer answers.
const char kNetHello[8] = {'F', 'S', 'D', 'P', 'N', 'E', 'T', '1'};

std::string connect_hint()
{
    return "; if that address is not reachable from this host, start that rank with host "
           "(--host ADDR) set to an address the other hosts reach, or with "
           "GLOO_SOCKET_IFNAME=NAME (or ifname)";
}

// The full mesh of data connections, within dl: every rank listens on its
// address (a fresh port, published under c->keys + "/mesh"), connects to
// the ranks above it and accepts those below it. A connection counts once
// its hello (this context's keys and the rank) is answered, so a listener
// that accepts but never speaks is a timeout naming its rank.
void connect_mesh(fsdp_gloo_ctx *c, const Deadline &dl, int timeout_ms)
{
    if (c->size == 1) return;
    const std::string me = "fsdp_gloo_connect on rank " + str(c->rank) + ": ";
    struct sockaddr_storage a = c->laddr;
    if (a.ss_family == AF_INET6) reinterpret_cast<struct sockaddr_in6 *>(&a)->sin6_port = 0;
    else reinterpret_cast<struct sockaddr_in *>(&a)->sin_port = 0;
    Sock lfd(socket(a.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    socklen_t len = sa_len(a);
    if (lfd.fd < 0 || bind(lfd.fd, (struct sockaddr *)&a, len) != 0 ||
        listen(lfd.fd, c->size + 8) != 0 ||
        getsockname(lfd.fd, (struct sockaddr *)&a, &len) != 0)
        throw Failure(FSDP_GLOO_ERROR, me + "cannot listen on " + c->address + ": " +
                                           strerror(errno));
    fcntl(lfd.fd, F_SETFL, fcntl(lfd.fd, F_GETFL) | O_NONBLOCK);
    std::string mine(kNetHello, sizeof kNetHello);
    mine.append(reinterpret_cast<const char *>(&a), sizeof a);
    c->store->set(c->keys + "/mesh/" + str(c->rank), mine);
    std::vector<Sock> fds((size_t)c->size);
    std::string hello(kNetHello, sizeof kNetHello);
    uint32_t nr = htonl((uint32_t)c->rank), nk = htonl((uint32_t)c->keys.size());
    hello.append(reinterpret_cast<const char *>(&nr), 4);
    hello.append(reinterpret_cast<const char *>(&nk), 4);
    hello += c->keys;
    auto fail_io = [&](int j, int rc) {
        bool to = rc == 0;
        throw Failure(to ? FSDP_GLOO_TIMEOUT : FSDP_GLOO_ERROR,
                      me + "connecting to " + peer(c, j) + " failed" +
                          (to ? " within " + str(timeout_ms) + " ms: no answer"
                              : std::string(": ") +
                                    (errno ? strerror(errno) : "connection closed")) +
                          connect_hint());
    };
    for (int j = c->rank + 1; j < c->size; j++) {
        std::string theirs;
        while (!c->store->get(c->keys + "/mesh/" + str(j), &theirs)) {
            if (dl.passed())
                throw Failure(FSDP_GLOO_TIMEOUT,
                              me + peer(c, j) + " did not publish its connection address within " +
                                  str(timeout_ms) + " ms (" + c->store->where() + ")");
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        struct sockaddr_storage pa;
        if (theirs.size() != sizeof kNetHello + sizeof pa ||
            theirs.compare(0, sizeof kNetHello, kNetHello, sizeof kNetHello) != 0)
            throw Failure(FSDP_GLOO_ERROR, me + peer(c, j) + " published a malformed address");
        memcpy(&pa, theirs.data() + sizeof kNetHello, sizeof pa);
        Sock s(socket(pa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (s.fd < 0) fail_io(j, -1);
        data_socket(s.fd);
        if (connect(s.fd, (struct sockaddr *)&pa, sa_len(pa)) != 0) {
            if (errno != EINPROGRESS) fail_io(j, -1);
            if (!wait_fd(s.fd, POLLOUT, dl)) fail_io(j, 0);
            int e = 0;
            socklen_t el = sizeof e;
            getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &e, &el);
            if (e) {
                errno = e;
                fail_io(j, -1);
            }
        }
        int rc = io_all(s.fd, &hello[0], hello.size(), true, dl);
        if (rc != 1) fail_io(j, rc);
        fds[(size_t)j].fd = s.release();
    }
    // the ranks below this one connect here
    for (int got = 0; got < c->rank;) {
        int fd = accept4(lfd.fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                throw Failure(FSDP_GLOO_ERROR, me + "accept: " + strerror(errno));
            if (!wait_fd(lfd.fd, POLLIN, dl)) {
                std::vector<int> missing;
                for (int j = 0; j < c->rank; j++)
                    if (fds[(size_t)j].fd < 0) missing.push_back(j);
                std::string who = missing.size() == 1 ? peer(c, missing[0]) : rank_list(missing);
                throw Failure(FSDP_GLOO_TIMEOUT, me + who + " did not connect within " +
                                                     str(timeout_ms) + " ms" + connect_hint());
            }
            continue;
        }
        Sock s(fd);
        data_socket(fd);
        char h[sizeof kNetHello + 8];
        uint32_t jr, kl;
        if (io_all(fd, h, sizeof h, false, dl) != 1 ||
            memcmp(h, kNetHello, sizeof kNetHello) != 0)
            continue; // not one of ours (or too late): drop it
        memcpy(&jr, h + sizeof kNetHello, 4);
        memcpy(&kl, h + sizeof kNetHello + 4, 4);
        jr = ntohl(jr);
        kl = ntohl(kl);
        if (kl != c->keys.size()) continue;
        std::string k(kl, '\0');
        if (kl && io_all(fd, &k[0], kl, false, dl) != 1) continue;
        if (k != c->keys || (int)jr >= c->rank || fds[jr].fd >= 0) continue;
        char ok = 1;
        if (io_all(fd, &ok, 1, true, dl) != 1) continue;
        fds[jr].fd = s.release();
        got++;
    }
    for (int j = c->rank + 1; j < c->size; j++) {
        char ok = 0;
        int rc = io_all(fds[(size_t)j].fd, &ok, 1, false, dl);
        if (rc != 1) fail_io(j, rc);
    }
    c->fds.assign((size_t)c->size, -1);
    for (int j = 0; j < c->size; j++) c->fds[(size_t)j] = fds[(size_t)j].release();
}

std::string hello_value(const fsdp_gloo_ctx *c)
{
    return "size=" + str(c->size) + "\nhost=" + this_host() + "\naddr=" + c->address +
           "\npid=" + str((int)getpid()) + "\n";
}

// Whether the job record rec is dead, and why. A directory store's record
// is dead when its rank 0 ran on this host and is gone, or its heartbeat
// stopped more than kStaleMs ago. A TCP store's record lives with rank 0.
const long kStaleMs = 10000;
bool record_dead(KV &kv, const std::string &key, const std::string &rec, std::string *why)
{
    if (kv.owner_alive()) return false;
    auto m = parse_kv(rec);
    int pid = atoi(m["pid"].c_str());
    if (m["host"] == this_host() && pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
        *why = "its rank 0 (pid " + str(pid) + " on this host) is gone";
        return true;
    }
    long age = kv.age_ms(key);
    if (age > kStaleMs) {
        *why = "its heartbeat stopped " + str((int)(age / 1000)) + " s ago";
        return true;
    }
    return false;
}

std::string describe(const std::string &rec)
{
    auto m = parse_kv(rec);
    return "job " + m["id"] + " (rank 0: pid " + m["pid"] + " on host " + m["host"] + ", " +
           m["size"] + " ranks)";
}

std::string use_another(const fsdp_gloo_ctx *)
{
    return "give each job its own prefix (fsdp_gloo_desc.prefix; the examples' --prefix) or "
           "store (store_dir, --store-dir; master_port, --master HOST:PORT)";
}

// Rank 0: the job record, created exclusively; a dead job's is taken over.
void start_job(fsdp_gloo_ctx *c, const fsdp_gloo_opts *o)
{
    KV &kv = *c->store;
    std::string key = c->prefix + "/job";
    c->job = o->job_id && *o->job_id ? o->job_id : fresh_id();
    c->record = "id=" + c->job + "\nhost=" + this_host() + "\npid=" + str((int)getpid()) +
                "\nsize=" + str(c->size) + "\n";
    for (int attempt = 0;; attempt++) {
        if (kv.create(key, c->record)) break;
        std::string old, why;
        if (!kv.get(key, &old)) continue; // just ended
        if (attempt > 20 || !record_dead(kv, key, old, &why))
            throw Failure(FSDP_GLOO_INVALID,
                          "fsdp_gloo_connect on rank 0: " + kv.where() + ", prefix " + c->prefix +
                              " is in use by " +
                              describe(old) + ", which is still running; two jobs never share "
                              "a prefix: " + use_another(c) + ", or wait for that job to end");
        // a dead job: move its record aside (one taker wins), then its keys
        std::string aside = key + ".dead." + fresh_id();
        DirStore *ds = dynamic_cast<DirStore *>(&kv);
        if (ds && rename(ds->path(key).c_str(), ds->path(aside).c_str()) == 0) {
            std::string moved;
            if (kv.get(aside, &moved) && moved == old) {
                kv.remove(c->prefix + "/" + parse_kv(old)["id"]);
            } else if (!moved.empty()) {
                // someone replaced it meanwhile: give it back
                link(ds->path(aside).c_str(), ds->path(key).c_str());
            }
            kv.remove(aside);
        }
    }
    c->owner = true;
    c->keys = c->prefix + "/" + c->job;
    if (!c->store->owner_alive()) {
        // the heartbeat that tells later jobs this one is alive
        fsdp_gloo_ctx *self = c;
        c->beat = std::thread([self, key] {
            std::unique_lock<std::mutex> g(self->beat_mu);
            while (!self->beat_cv.wait_for(g, std::chrono::seconds(1),
                                           [self] { return self->beat_stop; })) {
                try {
                    self->store->touch(key);
                } catch (...) {
                }
            }
        });
    }
    c->store->set(c->keys + "/hello/0", hello_value(c));
}

// Every rank: wait for all ranks of the job; others first find the job
// (the live record rank 0 created) and claim their rank in it once.
void join_job(fsdp_gloo_ctx *c, const fsdp_gloo_opts *o, const Deadline &dl, int timeout_ms)
{
    KV &kv = *c->store;
    std::string key = c->prefix + "/job", joined = c->rank == 0 ? c->job : "", conflict,
                foreign, dead;
    std::vector<int> missing;
    std::vector<std::string> hellos((size_t)c->size);
    for (;;) {
        if (c->rank != 0) {
            std::string rec, why;
            if (kv.get(key, &rec)) {
                std::string id = parse_kv(rec)["id"];
                if (id != joined) {
                    if (!joined.empty()) { // our job's record is gone: it died
                        kv.remove(c->prefix + "/" + joined + "/hello/" + str(c->rank));
                        joined.clear();
                    }
                    if (o->job_id && *o->job_id && id != o->job_id) {
                        foreign = rec;
                    } else if (record_dead(kv, key, rec, &why)) {
                        dead = describe(rec) + ": " + why;
                    } else if (kv.create(c->prefix + "/" + id + "/hello/" + str(c->rank),
                                         hello_value(c))) {
                        joined = id;
                        conflict.clear();
                    } else {
                        conflict = rec;
                    }
                }
            }
        }
        missing.clear();
        if (!joined.empty())
            for (int k = 0; k < c->size; k++)
                if (hellos[(size_t)k].empty() &&
                    !kv.get(c->prefix + "/" + joined + "/hello/" + str(k), &hellos[(size_t)k]))
                    missing.push_back(k);
        if (!joined.empty() && missing.empty()) break;
        if (dl.passed()) {
            std::string m = "fsdp_gloo_connect on rank " + str(c->rank) + ": ";
            if (!joined.empty()) {
                m = "fsdp_gloo_connect on rank " + str(c->rank) + ": " + rank_list(missing) +
                    " of " + str(c->size) + " did not arrive within " + str(timeout_ms) +
                    " ms (" + kv.where() + ", prefix " + c->prefix + ", job " + joined + ")";
                throw Failure(FSDP_GLOO_TIMEOUT, m);
            }
            if (!conflict.empty())
                throw Failure(FSDP_GLOO_INVALID,
                              m + kv.where() + ", prefix " + c->prefix + " belongs to " +
                                  describe(conflict) + ", which already has a rank " +
                                  str(c->rank) + ": another job uses this store and prefix; " +
                                  use_another(c));
            if (!foreign.empty())
                throw Failure(FSDP_GLOO_TIMEOUT,
                              m + "rank 0 of job " + o->job_id + " did not arrive within " +
                                  str(timeout_ms) + " ms; " + kv.where() + ", prefix " +
                                  c->prefix + " holds " + describe(foreign) + " instead");
            throw Failure(FSDP_GLOO_TIMEOUT,
                          "fsdp_gloo_connect on rank " + str(c->rank) + ": rank 0 of " +
                              str(c->size) + " did not arrive within " + str(timeout_ms) +
                              " ms (" + kv.where() + ", prefix " + c->prefix + ": " +
                              (dead.empty() ? "no job record" : "only the dead " + dead) + ")");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    c->job = joined;
    c->keys = c->prefix + "/" + joined;
    // every rank started with the same world size; loopback across hosts
    std::string mine = std::to_string(c->size);
    c->peers.resize((size_t)c->size);
    std::string host0, loop_rank;
    bool hosts_differ = false;
    for (int k = 0; k < c->size; k++) {
        auto m = parse_kv(hellos[(size_t)k]);
        c->peers[(size_t)k] = m["addr"] + " on " + m["host"];
        if (m["size"] != mine)
            throw Failure(FSDP_GLOO_INVALID, "fsdp_gloo_connect on rank " + str(c->rank) +
                                                 ": wrong world size: rank " + str(k) +
                                                 " was started with " + m["size"] +
                                                 " ranks, this rank with " + mine);
        if (k == 0) host0 = m["host"];
        else if (m["host"] != host0) hosts_differ = true;
        if (loop_rank.empty() && is_loopback(m["addr"])) loop_rank = str(k);
    }
    if (hosts_differ && !loop_rank.empty())
        throw Failure(FSDP_GLOO_INVALID,
                      "fsdp_gloo_connect on rank " + str(c->rank) + ": rank " + loop_rank +
                          " listens on a loopback address (" + c->peers[(size_t)atoi(loop_rank.c_str())] +
                          ") but the ranks run on several hosts; start it with host (--host ADDR) "
                          "set to an address the other hosts reach, or GLOO_SOCKET_IFNAME=NAME "
                          "(or ifname)");
}

} // namespace

extern "C" int fsdp_gloo_connect_opts(const fsdp_gloo_opts *o, fsdp_gloo_ctx **out, char *err,
                                      size_t cap)
{
    if (!out) return fail(err, cap, FSDP_GLOO_ERROR, "fsdp_gloo_connect: out is NULL");
    *out = nullptr;
    if (!o) return fail(err, cap, FSDP_GLOO_ERROR, "fsdp_gloo_connect: opts is NULL");
    bool dir = o->store_dir && *o->store_dir, tcp = o->master_addr && *o->master_addr;
    if (dir == tcp)
        return fail(err, cap, FSDP_GLOO_INVALID,
                    dir ? "fsdp_gloo_connect: both a store directory and a master address; "
                          "set one"
                        : "fsdp_gloo_connect: no store: set a store directory or a master "
                          "address");
    if (tcp && (o->master_port < 1 || o->master_port > 65535))
        return fail(err, cap, FSDP_GLOO_INVALID,
                    "fsdp_gloo_connect: master port " + str(o->master_port) +
                        " is not in [1, 65535]");
    if (o->size < 1 || o->rank < 0 || o->rank >= o->size)
        return fail(err, cap, FSDP_GLOO_INVALID,
                    "fsdp_gloo_connect: rank " + str(o->rank) + " is not in [0, " +
                        str(o->size) + ")");
    try {
        Deadline dl(o->timeout_ms);
        std::unique_ptr<fsdp_gloo_ctx> c(new fsdp_gloo_ctx);
        c->rank = o->rank;
        c->size = o->size;
        c->prefix = o->prefix && *o->prefix ? o->prefix : "fsdp";
        std::string how;
        c->dev = make_device(o, &how, &c->laddr);
        c->address = c->dev->str(); // "tcp, pci=, iface=lo, speed=-1, addr=[127.0.0.1]"
        size_t at = c->address.find("addr=");
        if (at != std::string::npos) c->address = c->address.substr(at + 5);
        if (dir) c->store = std::make_shared<DirStore>(o->store_dir);
        else c->store = std::make_shared<TcpStore>(o->master_addr, o->master_port, o->rank, dl,
                                                   o->timeout_ms);
        if (c->rank == 0) start_job(c.get(), o);
        join_job(c.get(), o, dl, o->timeout_ms);
        connect_mesh(c.get(), dl, o->timeout_ms);
        *out = c.release();
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "fsdp_gloo_connect", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "fsdp_gloo_connect: unknown C++ exception");
    }
}

extern "C" int fsdp_gloo_connect(const char *store_dir, const char *prefix, const char *host,
                                 int rank, int size, int timeout_ms, fsdp_gloo_ctx **out,
                                 char *err, size_t cap)
{
    fsdp_gloo_opts o;
    memset(&o, 0, sizeof o);
    o.store_dir = store_dir;
    o.prefix = prefix;
    o.host = host;
    o.rank = rank;
    o.size = size;
    o.timeout_ms = timeout_ms;
    return fsdp_gloo_connect_opts(&o, out, err, cap);
}

extern "C" int fsdp_gloo_rank(const fsdp_gloo_ctx *c) { return c ? c->rank : -1; }
extern "C" int fsdp_gloo_size(const fsdp_gloo_ctx *c) { return c ? c->size : 0; }
extern "C" const char *fsdp_gloo_job_id(const fsdp_gloo_ctx *c) { return c ? c->job.c_str() : ""; }
extern "C" const char *fsdp_gloo_address(const fsdp_gloo_ctx *c)
{
    return c ? c->address.c_str() : "";
}

namespace {

// ---------------------------------------------------------------- the data path
//
// Collectives run on the calling thread over the mesh's sockets: each
// message is a header (which collective, the call's number, offset and
// length) and the bytes, written and read straight from the caller's
// buffers with nonblocking send/recv, poll() only when no socket can move.
// Gloo's own pairs hand every message to their device thread and wake the
// caller through a condition variable, and rendezvous each unbound buffer
// with a notification: on few cores the threads fight for them and
// train_gpt ran 3-10x as long as over MPI.

const uint32_t kMsgMagic = 0x46534450u; // "FSDP"

struct Hdr {
    uint32_t magic, op;
    uint64_t call, off, len, key;
};

const char *op_name(uint32_t op)
{
    static const char *const names[] = {"?", "all_gather", "all_to_all", "broadcast", "barrier"};
    return op < 5 ? names[op] : "?";
}

struct Xfer {
    Hdr h;       // to send, or expected
    Hdr got;     // as received
    char *p;     // the bytes
    size_t done; // of sizeof(Hdr) + h.len
};

// One collective's messages to and from each peer, moved in order per peer.
struct Exchange {
    fsdp_gloo_ctx *c;
    uint32_t op;
    uint64_t call, key;
    std::vector<std::vector<Xfer>> sq, rq; // per peer
    std::vector<size_t> si, ri;            // first unfinished message per peer
    std::vector<char> ok;                  // peer_ok said 1 (fsdp_gloo_set_check)
    size_t left = 0;                       // messages not finished
    Exchange(fsdp_gloo_ctx *ctx, uint32_t o)
        : c(ctx), op(o), call(ctx->calls++), key(ctx->key), sq((size_t)ctx->size),
          rq((size_t)ctx->size),
          si((size_t)ctx->size), ri((size_t)ctx->size),
          ok((size_t)ctx->size, !ctx->peer_ok || !ctx->key)
    {
    }
    // Whether peer j's bytes may be read: its call is known to be this one
    // (with key 0 they may be read at once: only waits look). A peer that
    // made another call ends this one.
    bool allowed(int j) { return ok[(size_t)j] || look(j); }
    bool look(int j)
    {
        int v = c->peer_ok(c->peer_user, j);
        if (v < 0)
            throw Failure(FSDP_GLOO_MISMATCH, std::string(op_name(op)) + " on rank " +
                                                  str(c->rank) + ": " + peer(c, j) +
                                                  " made another call");
        if (!key) return true; // the engine's own exchange: only waits look
        ok[(size_t)j] = v > 0;
        return v > 0;
    }
    void add(std::vector<std::vector<Xfer>> &q, int j, const void *p, size_t off, size_t len)
    {
        Xfer x;
        x.h.magic = kMsgMagic;
        x.h.op = op;
        x.h.call = call;
        x.h.off = off;
        x.h.len = len;
        x.h.key = key;
        memset(&x.got, 0, sizeof x.got);
        x.p = static_cast<char *>(const_cast<void *>(p));
        x.done = 0;
        q[(size_t)j].push_back(x);
        left++;
    }
    void send(int j, const void *p, size_t off, size_t len) { add(sq, j, p, off, len); }
    void recv(int j, void *p, size_t off, size_t len) { add(rq, j, p, off, len); }

    [[noreturn]] void broken(int j, int e)
    {
        throw Failure(FSDP_GLOO_ERROR,
                      std::string(op_name(op)) + " on rank " + str(c->rank) +
                          ": the connection to " + peer(c, j) + " failed: " +
                          (e ? strerror(e) : "closed by the peer (it exited or crashed)"));
    }
    void check(int j, const Xfer &x)
    {
        const Hdr &g = x.got, &w = x.h;
        if (g.magic == w.magic && g.op == w.op && g.call == w.call && g.off == w.off &&
            g.len == w.len && g.key == w.key)
            return;
        if (g.magic == w.magic && g.key != w.key)
            throw Failure(FSDP_GLOO_MISMATCH, std::string(op_name(op)) + " on rank " +
                                                  str(c->rank) + ": " + peer(c, j) +
                                                  " sent the data of another call");
        if (g.magic != kMsgMagic)
            throw Failure(FSDP_GLOO_ERROR, std::string(op_name(op)) + " on rank " +
                                               str(c->rank) + ": " + peer(c, j) +
                                               " sent bytes that are not a message");
        throw Failure(FSDP_GLOO_ERROR,
                      std::string(op_name(op)) + " on rank " + str(c->rank) + ": " + peer(c, j) +
                          " sent " + op_name(g.op) + " #" + std::to_string(g.call) + " (" +
                          std::to_string(g.len) + " bytes at " + std::to_string(g.off) +
                          ") where this rank runs " + op_name(op) + " #" +
                          std::to_string(call) + " (" + std::to_string(w.len) + " bytes at " +
                          std::to_string(w.off) + "): the ranks called different collectives "
                                                  "or sizes");
    }
    // What is left of message x: the rest of its header (hdr: the one to
    // send, or where the received one lands), then the rest of its bytes.
    static int rest(Xfer &x, Hdr *hdr, struct iovec v[2])
    {
        int nv = 0;
        size_t hb = sizeof(Hdr);
        if (x.done < hb) v[nv++] = {reinterpret_cast<char *>(hdr) + x.done, hb - x.done};
        size_t pd = x.done > hb ? x.done - hb : 0;
        if (x.h.len > pd) v[nv++] = {x.p + pd, (size_t)x.h.len - pd};
        return nv;
    }
    // Moves what the sockets take without blocking; true if anything moved.
    bool pump(int j)
    {
        int fd = c->fds[(size_t)j];
        bool moved = false;
        while (si[(size_t)j] < sq[(size_t)j].size()) {
            Xfer &x = sq[(size_t)j][si[(size_t)j]];
            struct iovec v[2];
            int nv = rest(x, &x.h, v);
            size_t hb = sizeof(Hdr);
            struct msghdr m;
            memset(&m, 0, sizeof m);
            m.msg_iov = v;
            m.msg_iovlen = (size_t)nv;
            ssize_t k = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN || errno == EWOULDBLOCK) break;
                broken(j, errno);
            }
            moved = moved || k > 0;
            x.done += (size_t)k;
            if (x.done < hb + x.h.len) break;
            si[(size_t)j]++;
            left--;
        }
        while (ri[(size_t)j] < rq[(size_t)j].size() && allowed(j)) {
            Xfer &x = rq[(size_t)j][ri[(size_t)j]];
            struct iovec v[2];
            int nv = rest(x, &x.got, v);
            size_t hb = sizeof(Hdr);
            ssize_t k = readv(fd, v, nv);
            if (k < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN || errno == EWOULDBLOCK) break;
                broken(j, errno);
            }
            if (k == 0) broken(j, 0);
            moved = true;
            bool had = x.done >= hb;
            x.done += (size_t)k;
            // the header is checked once it is in. The same readv may
            // have put payload bytes behind it into this call's buffer,
            // which is why a peer is read only once allowed(j); a header
            // that disagrees ends the call with an error.
            if (!had && x.done >= hb) check(j, x);
            if (x.done < hb + x.h.len) break;
            ri[(size_t)j]++;
            left--;
        }
        return moved;
    }
    // Runs until every message is through, calling progress() after every
    // pass that moved something; past dl, a timeout naming the peers whose
    // data did not come (or, with all received, that did not take ours).
    template <class F> void run(const Deadline &dl, int timeout_ms, F progress)
    {
        std::vector<struct pollfd> p;
        std::vector<int> who;
        // Most waits in a training step are 20-100 us (train_gpt, 2 ranks):
        // polling that long, giving the core away between polls, saves a
        // sleep and a wake-up each; longer waits sleep in poll().
        const auto spin = std::chrono::microseconds(100);
        Clock::time_point idle;
        int spins = 0;
        while (left) {
            bool moved = false;
            for (int j = 0; j < c->size; j++)
                if (j != c->rank && pump(j)) moved = true;
            if (moved) {
                spins = 0;
                progress();
                continue;
            }
            if (!left) break;
            // a peer waited on may have made another call
            for (int j = 0; c->peer_ok && j < c->size; j++)
                if (j != c->rank && (!ok[(size_t)j] || !key) &&
                    (si[(size_t)j] < sq[(size_t)j].size() || ri[(size_t)j] < rq[(size_t)j].size()))
                    look(j);
            if (spins == 0) idle = Clock::now();
            if (++spins < 16) continue;
            if (Clock::now() - idle < spin) {
                sched_yield();
                continue;
            }
            p.clear();
            who.clear();
            for (int j = 0; j < c->size; j++) {
                if (j == c->rank) continue;
                short ev = 0;
                if (ri[(size_t)j] < rq[(size_t)j].size()) ev |= POLLIN;
                if (si[(size_t)j] < sq[(size_t)j].size()) ev |= POLLOUT;
                if (!ev) continue;
                p.push_back({c->fds[(size_t)j], ev, 0});
                who.push_back(j);
            }
            long ms = dl.forever ? -1 : (long)dl.left().count();
            if (c->peer_ok && (ms < 0 || ms > 1)) ms = 1; // peer_ok's look, every millisecond
            int rc = poll(p.data(), (nfds_t)p.size(), ms > INT32_MAX ? INT32_MAX : (int)ms);
            if (rc < 0 && errno != EINTR)
                throw Failure(FSDP_GLOO_ERROR, std::string(op_name(op)) + " on rank " +
                                                   str(c->rank) + ": poll: " + strerror(errno));
            // a peer whose bytes are not read yet (peer_ok) but whose socket
            // woke us: gone, unless its bytes are there (then its call shows)
            for (size_t i = 0; rc > 0 && i < p.size(); i++) {
                int j = who[i];
                if (ok[(size_t)j] || !(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
                char b;
                ssize_t k = ::recv(p[i].fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
                if (k == 0) broken(j, 0);
                if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    broken(j, errno);
            }
            if (dl.passed()) late(timeout_ms);
        }
    }
    void run(const Deadline &dl, int timeout_ms)
    {
        run(dl, timeout_ms, [] {});
    }
    [[noreturn]] void late(int timeout_ms)
    {
        std::vector<int> in, out;
        for (int j = 0; j < c->size; j++) {
            if (j == c->rank) continue;
            if (ri[(size_t)j] < rq[(size_t)j].size()) in.push_back(j);
            else if (si[(size_t)j] < sq[(size_t)j].size()) out.push_back(j);
        }
        bool send = in.empty();
        std::vector<int> &l = send ? out : in;
        std::string who = l.size() == 1 ? peer(c, l[0]) : rank_list(l);
        throw Failure(FSDP_GLOO_TIMEOUT,
                      std::string(op_name(op)) + " on rank " + str(c->rank) + ": " +
                          (send ? "sending to " + who + " did not complete"
                                : "nothing arrived from " + who) +
                          " within " + str(timeout_ms) +
                          " ms (not at this collective yet, stuck, or gone)");
    }
};

} // namespace

extern "C" int fsdp_gloo_all_gather(fsdp_gloo_ctx *c, const void *send, void *recv,
                                    size_t bytes, int timeout_ms, char *err, size_t cap)
{
    try {
        char *out = static_cast<char *>(recv);
        size_t n = (size_t)c->size, r = (size_t)c->rank;
        if (send && send != out + r * bytes) std::memcpy(out + r * bytes, send, bytes);
        if (n == 1 || bytes == 0) return FSDP_GLOO_OK;
        Deadline dl(timeout_ms);
        Exchange x(c, 1);
        for (size_t j = 0; j < n; j++)
            if (j != r) x.recv((int)j, out + j * bytes, 0, bytes);
        for (size_t i = 1; i < n; i++) // start at our right neighbour: no hot spot
            x.send((int)((r + i) % n), out + r * bytes, 0, bytes);
        x.run(dl, timeout_ms);
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "all_gather", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "all_gather: unknown C++ exception");
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
        if (nch == 0) return FSDP_GLOO_OK;
        Deadline dl(timeout_ms);
        // every chunk queued at once, each peer's in order: done() sums chunk
        // k while the kernel's buffers take the later ones
        Exchange x(c, 2);
        for (k = 0; k < nch; k++)
            for (j = 0; j < n; j++)
                if (j != r)
                    x.recv((int)j, static_cast<char *>(recv_blocks[j]) + k * chunk, k * chunk,
                           std::min(chunk, bytes - k * chunk));
        for (k = 0; k < nch; k++)
            for (size_t i = 1; i < n; i++) {
                size_t to = (r + i) % n; // start at our right neighbour: no hot spot
                x.send((int)to, in + to * bytes + k * chunk, k * chunk,
                       std::min(chunk, bytes - k * chunk));
            }
        size_t reported = 0;
        auto report = [&] {
            size_t ready = nch;
            for (size_t p = 0; p < n; p++)
                if (p != r) ready = std::min(ready, x.ri[p]);
            for (; reported < ready; reported++)
                done(user, reported * chunk, std::min(chunk, bytes - reported * chunk));
        };
        x.run(dl, timeout_ms, report);
        report();
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "all_to_all", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "all_to_all: unknown C++ exception");
    }
}

namespace {
void no_done(void *, size_t, size_t) {}
} // namespace

extern "C" int fsdp_gloo_all_to_all(fsdp_gloo_ctx *c, const void *send, void *recv,
                                    size_t bytes, int timeout_ms, char *err, size_t cap)
{
    size_t n = (size_t)c->size, r = (size_t)c->rank;
    char *out = static_cast<char *>(recv);
    if (n == 1 || bytes == 0) {
        if (send != recv) std::memmove(recv, send, bytes * n);
        return FSDP_GLOO_OK;
    }
    std::vector<char> copy;
    if (send == recv) { // in place: the blocks to send must outlive the receives
        copy.assign(static_cast<const char *>(send), static_cast<const char *>(send) + bytes * n);
        send = copy.data();
    }
    std::memcpy(out + r * bytes, static_cast<const char *>(send) + r * bytes, bytes);
    std::vector<void *> blocks(n);
    for (size_t j = 0; j < n; j++) blocks[j] = out + j * bytes;
    return fsdp_gloo_all_to_all_chunked(c, send, blocks.data(), bytes, bytes, no_done, nullptr,
                                        timeout_ms, err, cap);
}

extern "C" int fsdp_gloo_broadcast(fsdp_gloo_ctx *c, void *buf, size_t bytes, int root,
                                   int timeout_ms, char *err, size_t cap)
{
    try {
        size_t n = (size_t)c->size, r = (size_t)c->rank;
        if (n == 1 || bytes == 0) return FSDP_GLOO_OK;
        Deadline dl(timeout_ms);
        Exchange x(c, 3);
        if ((int)r == root) {
            for (size_t i = 1; i < n; i++) x.send((int)((r + i) % n), buf, 0, bytes);
        } else {
            x.recv(root, buf, 0, bytes);
        }
        x.run(dl, timeout_ms);
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "broadcast", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "broadcast: unknown C++ exception");
    }
}

extern "C" int fsdp_gloo_barrier(fsdp_gloo_ctx *c, int timeout_ms, char *err, size_t cap)
{
    try {
        size_t n = (size_t)c->size, r = (size_t)c->rank;
        if (n == 1) return FSDP_GLOO_OK;
        Deadline dl(timeout_ms);
        std::vector<char> in(n), token(1, 1);
        Exchange x(c, 4);
        for (size_t j = 0; j < n; j++)
            if (j != r) {
                x.recv((int)j, &in[j], 0, 1);
                x.send((int)j, token.data(), 0, 1);
            }
        x.run(dl, timeout_ms);
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "barrier", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "barrier: unknown C++ exception");
    }
}

extern "C" int fsdp_gloo_split(fsdp_gloo_ctx *c, int color, int key, int timeout_ms,
                               fsdp_gloo_ctx **out, char *err, size_t cap)
{
    *out = nullptr;
    try {
        // every rank learns every (color, key), then each group connects
        // through its own keys in the same store
        std::vector<int> mine = {color, key}, all((size_t)c->size * 2);
        int r = fsdp_gloo_all_gather(c, mine.data(), all.data(), sizeof(int) * 2, timeout_ms, err,
                                     cap);
        if (r != FSDP_GLOO_OK) return r;
        unsigned n = c->splits++;
        std::unique_ptr<fsdp_gloo_ctx> nc;
        if (color >= 0) {
            std::vector<std::pair<int, int>> members; // (key, rank)
            for (int j = 0; j < c->size; j++)
                if (all[2 * (size_t)j] == color) members.push_back({all[2 * (size_t)j + 1], j});
            std::sort(members.begin(), members.end());
            nc.reset(new fsdp_gloo_ctx);
            nc->store = c->store;
            nc->dev = c->dev;
            nc->laddr = c->laddr;
            nc->prefix = c->prefix;
            nc->job = c->job;
            nc->address = c->address;
            nc->keys = c->keys + "/split" + std::to_string(n) + "/" + std::to_string(color);
            nc->size = (int)members.size();
            for (size_t i = 0; i < members.size(); i++) {
                if (members[i].second == c->rank) nc->rank = (int)i;
                nc->peers.push_back(c->peers.empty() ? std::string()
                                                     : c->peers[(size_t)members[i].second]);
            }
            Deadline dl(timeout_ms);
            connect_mesh(nc.get(), dl, timeout_ms);
        }
        // every group has read its keys before anyone (rank 0) may end the job
        r = fsdp_gloo_barrier(c, timeout_ms, err, cap);
        if (r != FSDP_GLOO_OK) return r;
        *out = nc.release();
        return FSDP_GLOO_OK;
    } catch (const std::exception &e) {
        return fail_exception(err, cap, "split", e);
    } catch (...) {
        return fail(err, cap, FSDP_GLOO_ERROR, "split: unknown C++ exception");
    }
}

extern "C" void fsdp_gloo_set_check(fsdp_gloo_ctx *c, unsigned long long key,
                                    int (*peer_ok)(void *user, int peer), void *user)
{
    if (!c) return;
    c->key = key;
    c->peer_ok = peer_ok;
    c->peer_user = user;
}

extern "C" void fsdp_gloo_free(fsdp_gloo_ctx *c)
{
    try {
        delete c;
    } catch (...) {
        // a destructor that throws has nothing left to tell anyone
    }
}

extern "C" int fsdp_gloo_pin_local_rank(int rank, int size)
{
    cpu_set_t allowed, one;
    if (rank < 0 || size < 1 || rank >= size) {
        errno = EINVAL;
        return -1;
    }
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return -1;
    // a lone rank keeps every CPU; more ranks than CPUs: round robin
    int n = CPU_COUNT(&allowed);
    if (size == 1 || n < 1) return 0;
    CPU_ZERO(&one);
    for (int cpu = 0, k = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &allowed) && k++ == rank % n) {
            CPU_SET(cpu, &one);
            break;
        }
    return sched_setaffinity(0, sizeof one, &one) == 0 ? 1 : -1;
}
