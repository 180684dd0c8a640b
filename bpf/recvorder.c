//go:build ignore

// recvorder.c: the receive-order recorder (receive determinants, issue 11).
//
// A BTF raw tracepoint on sock_recv_length, which fires in
// sock_recvmsg_nosec after a protocol's recvmsg returned, in the context of
// the task that made the call (recv, recvfrom, recvmsg, recvmmsg, read and
// readv on a socket, io_uring's recv). For every such call that
//   - is made by a task in the jobs' parent cgroup or below it (parent, a
//     one-entry cgroup array the loader fills with the agent's cgroup_parent
//     directory), by a task in a job cgroup (a child of the parent),
//   - on a TCP socket of an IPv4 connection (AF_INET, or AF_INET6 with
//     IPv4-mapped addresses: a dual-stack listener's accepted IPv4
//     connection, as Go's net package makes them),
//   - that consumed something (ret > 0), or, with receive positions
//     (positions_on), found nothing to read (EAGAIN, recorded with len 0: a
//     replay must know that the thread looked at the socket there); other
//     errors and EOF are not recorded,
// it writes one struct recv_event to the ring buffer: the job cgroup, the
// connection, the socket's copied_seq after the call, ret, the call's flags
// and the caller's tgid/tid. With MSG_PEEK copied_seq does not move: the
// event says the bytes were looked at, not consumed. copied_seq counts the
// peer's FIN too: a call that consumes the last bytes of a segment that
// carries the FIN moves copied_seq one past them (tcp_recvmsg's
// found_fin_ok), a call that stops before such a segment does not.
// MSG_ERRQUEUE (timestamps, zerocopy completions) and MSG_OOB (the urgent
// byte) calls are recorded too, flags and all, and do not move copied_seq
// either: a consumer that replays the stream skips them.
//
// Order: the ring buffer is multi-producer, single-consumer; a reservation
// takes the ring's spinlock, so the order of records in the ring (the order
// the consumer reads them) is a total order of the reservations. A task
// reserves its event inside its receive system call, before the call
// returns, so the order is consistent with each thread's program order and
// with every happens-before relation between threads (a thread that
// receives after learning of another's receive, through a lock, a pipe, a
// shared variable, finds the other's event before its own). Only the order
// of truly concurrent calls of different threads is the ring's choice, and
// any choice is an order they could have run in.
//
// copied_seq is read after the call, without the socket lock: two threads
// receiving from the same socket at the same time may each see the other's
// bytes included. One reader per socket at a time (MPI, most servers) gives
// exact values.
//
// Not seen: receives that bypass recvmsg (splice and sendfile from a socket
// through tcp_read_sock, TCP_ZEROCOPY_RECEIVE, kTLS and sockmap redirects).
//
// Losses: an event whose reservation fails (the ring is full: the consumer
// is behind) cannot be written; the call itself is not delayed or failed.
// The loss is counted per job cgroup in lost (a hash map the consumer reads)
// before the call returns, so a consumer that drained the ring and then
// reads a job's lost counter as 0 holds every event of that job up to that
// point. A loss that cannot be attributed (lost map full) is counted in
// lost_unattributed: the consumer must then treat every job as incomplete.

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include "ringconsumer.h"

#define AF_INET 2
#define AF_INET6 10
#define IPPROTO_TCP 6
#define BPF_ANY 0
#define BPF_NOEXIST 1
#define SIGSTOP 19
#define MSG_OOB 1
#define MSG_PEEK 2
#define MSG_ERRQUEUE 0x2000
#define EINTR 4
#define EAGAIN 11
#define ERESTARTSYS 512
#define ERESTART_RESTARTBLOCK 516

// Deepest cgroup level the parent may be at (the kernel's limit is
// cgroup.max.depth, unlimited by default; real hierarchies are shallow).
#define MAX_LEVEL 32

char __license[] SEC("license") = "Dual BSD/GPL";

// The kernel structures, reduced to the fields read. The trimmed vmlinux.h
// does not have them (completing it would pull in most of the kernel's
// types); preserve_access_index relocates each field by name against the
// running kernel's BTF, through the anonymous unions they sit in.
struct in6_addr {
	union {
		__be32 u6_addr32[4];
	} in6_u;
} __attribute__((preserve_access_index));

struct sock_common {
	__be32 skc_daddr;       // remote address
	__be32 skc_rcv_saddr;   // local address
	__be16 skc_dport;       // remote port, network order
	__u16 skc_num;          // local port, host order
	unsigned short skc_family;
	struct in6_addr skc_v6_daddr;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
	__u16 sk_protocol;
} __attribute__((preserve_access_index));

struct tcp_sock {
	__u32 copied_seq; // the next byte the application will read
} __attribute__((preserve_access_index));

struct upid {
	int nr;
	void *ns;
} __attribute__((preserve_access_index));

struct pid {
	unsigned int level;
	struct upid numbers[1];
} __attribute__((preserve_access_index));

struct list_head {
	struct list_head *next;
} __attribute__((preserve_access_index));

struct task_struct {
	struct pid *thread_pid;
	struct task_struct *group_leader;
	struct list_head children;
} __attribute__((preserve_access_index));

// The system call number is orig_ax on x86-64, syscallno on arm64.
struct pt_regs {
	unsigned long orig_ax;
	long long syscallno;
} __attribute__((preserve_access_index));

// One ring buffer record per recorded receive call (kind EV_RECV), or per stop
// of a thread at an armed readiness call (kind EV_POLL_STOP: only cgroup_id,
// pid, tid, nstid, nspid and polls are set). Decoded by hand in
// ebpfprobes.DecodeRecvEvent: keep the two in step.
struct recv_event {
	__u64 cgroup_id;   // the job cgroup (child of the parent) of the caller
	__be32 laddr;      // this socket's address, network byte order
	__be32 raddr;      // the peer's address, network byte order
	__be16 lport;      // network byte order
	__be16 rport;      // network byte order
	__u32 copied_seq;  // the socket's copied_seq after the call
	__u32 len;         // the call's return value (> 0), 0 for EAGAIN
	__u32 flags;       // the call's MSG_* flags
	__u32 pid;         // tgid of the caller
	__u32 tid;         // thread id of the caller
	__u32 nstid;       // the caller's thread id in its own (the job's) PID namespace
	__u32 nspid;       // the caller's process id in that namespace
	__u32 kind;        // EV_RECV, EV_POLL_STOP or EV_HELD
	__u32 stopped;     // an armed stop: 1, the thread was sent SIGSTOP; 2 + errno, sending it failed
	__u64 polls;       // the thread's readiness calls so far (struct position)
};

#define EV_RECV 0
#define EV_POLL_STOP 1
// A receive call of a pessimistic job's thread, which was then stopped (stopped
// says how) until the agent has its determinant at the job's protector.
#define EV_HELD 2

_Static_assert(sizeof(struct recv_event) == 64, "recv_event must be 64 bytes without padding");

// Puts recv_event in the object's BTF, for bpf2go's Go twin of it.
const struct recv_event *unused_recv_event __attribute__((unused));

// Receive positions. A thread of a job that finds bytes by a readiness call
// (epoll_wait, poll, select and their variants) reads them after it; what a
// readiness call returns depends on which bytes had arrived. So each thread
// counts its readiness calls, and each receive call is stamped with the count:
// the replay can then make every bytes arrive between the same two readiness
// calls of the restored thread as in the original (intercept.Gate). Keyed by
// the job cgroup and the thread's id in the job's PID namespace, which CRIU
// restores. Calls that return EINTR or a restart code are not counted: they
// report nothing, and a dump or a stop makes them (a blocking epoll_wait
// returns EINTR when its process is stopped and continued); one that the
// kernel restarts through restart_syscall is counted when the restart ends. An entry lives as long as its
// thread (posexit), or its job (the loader's Forget).
struct thread_key {
	__u64 cgroup_id;
	__u32 nstid;
	__u32 pad;
};

struct position {
	__u64 polls;           // readiness calls that returned (not EINTR, not a restart)
	__u32 restart_pending; // the last one is to be restarted through restart_syscall
	__u32 pad;
};

// An armed stop of one thread (the replay's): SIGSTOP once its count of
// readiness calls reaches polls (a poll stop: lport 0), or right after a
// receive call it makes with that count on the connection of local port lport
// and remote port rport (network order) that returns len (0: EAGAIN) and
// leaves copied_seq at end (a receive stop).
struct stop {
	__u64 polls;
	__u32 end;
	__u32 len;
	__be16 lport;
	__be16 rport;
	__u32 pad;
};

// Set by the loader: the numbers of the readiness system calls on this
// architecture (unused slots repeat a number), and restart_syscall's.
volatile const __u32 poll_nr[7] = {};
volatile const __u32 restart_nr = 0;
// Set by the loader: nonzero when receive positions are recorded (pollexit is
// attached). Without them the receive program does none of their work: no
// namespace ids, no count, no calls that found nothing.
volatile const __u32 positions_on = 0;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct thread_key);
	__type(value, struct position);
} positions SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct thread_key);
	__type(value, struct stop);
} stops SEC(".maps");

// Pessimistic jobs (cgroup ids): each receive call that consumes bytes stops
// its thread's process (SIGSTOP) until the agent, having the call's
// determinant stored at the job's protector, continues it: nothing the process
// sends afterwards can depend on a determinant a crash could take.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u8);
} pessimistic SEC(".maps");

// Per-CPU counters; the loader sums them over CPUs.
struct order_counters {
	__u64 recorded;          // events written
	__u64 lost;              // events lost because the ring had no room
	__u64 lost_unattributed; // of those, lost with no room in the lost map either
	__u64 not_in_job;        // calls of tasks in the parent cgroup itself, not in a job below it
	__u64 non_ipv4;          // consuming calls on sockets of jobs that are not IPv4 TCP
	__u64 untracked;         // readiness calls not counted: the positions map was full (of live threads: posexit frees the dead's); each also lost
};

// Set by the loader: the ring buffer size in bytes, the wakeup threshold
// (see tcplog.c), and the cgroup id of the parent (its inode number).
volatile const __u32 ring_size = 0;
volatile const __u32 wake_bytes = 0;
volatile const __u64 parent_cgid = 0;
// Written by the consumer (mmapped .bss): nonzero to ignore consumer_polling
// and let the kernel wake a waiting consumer for every event. A consumer that
// gates on each event (the spare's replay) wants them at once rather than up
// to a poll interval late, but only while it gates: a wakeup costs the
// receiving call about a microsecond.
volatile __u32 wake_every = 0;

// Written by the consumer (mmapped .bss): nonzero while it polls the ring by
// itself (the scheme of tcplog.c).
volatile __u32 consumer_polling = 0;

// Written by the consumer (mmapped .bss): nonzero while some stop is armed,
// so that no call looks the stops map up otherwise.
volatile __u32 stops_armed = 0;

// Written by the consumer (mmapped .bss): nonzero while some job is
// pessimistic, so that no call looks the pessimistic map up otherwise.
volatile __u32 pessimistic_any = 0;

// Events lost so far, every job's together (the per-CPU stats' lost summed):
// the consumer reads it in the mmapped .bss after each drain, without a
// system call, and looks each job's count up only when it moved.
volatile __u64 lost_total = 0;

// The level of the job cgroups (the parent's + 1), found by the program the
// first time a task under the parent receives: the loader would have to
// guess it from a path, which a cgroup namespace shortens.
__u32 job_level = 0;

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22); // the loader overrides this
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_CGROUP_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} parent SEC(".maps");

// Events lost per job cgroup id. The consumer deletes a job's entry when it
// forgets the job.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u64);
} lost SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct order_counters);
} stats SEC(".maps");

// wake_flags returns the submit flags for a record of need ring bytes.
static __always_inline __u64 wake_flags(__u64 need)
{
	return ring_wake_flags(&events, !wake_every && consumer_polling, wake_bytes, need);
}

// find_job_level returns the level of the parent's children: the current
// task is under the parent, so the parent is one of its ancestors.
static __always_inline __u32 find_job_level(void)
{
	for (int l = 0; l < MAX_LEVEL; l++) {
		__u64 id = bpf_get_current_ancestor_cgroup_id(l);
		if (id == 0)
			return 0; // past the task's own cgroup: cannot happen
		if (id == parent_cgid)
			return l + 1;
	}
	return 0;
}

static __always_inline void count_lost_of(struct order_counters *c, __u64 cgid)
{
	__u64 one = 1;
	__u64 *n = bpf_map_lookup_elem(&lost, &cgid);
	if (n) {
		__sync_fetch_and_add(n, 1);
		return;
	}
	// Another CPU may create it first (BPF_NOEXIST fails): add to theirs.
	if (bpf_map_update_elem(&lost, &cgid, &one, BPF_NOEXIST) == 0)
		return;
	n = bpf_map_lookup_elem(&lost, &cgid);
	if (n) {
		__sync_fetch_and_add(n, 1);
		return;
	}
	c->lost_unattributed++;
}

static __always_inline void count_lost(struct order_counters *c, __u64 cgid)
{
	c->lost++;
	// The job's count first, the total last (a fetching atomic: fully ordered): the consumer reads the
	// total after each drain and the jobs' counts only when it moved, so a total counted first could move
	// while the job's count had not yet, and the hole in the job's record would go unnoticed for good.
	count_lost_of(c, cgid);
	__u64 total = __sync_fetch_and_add(&lost_total, 1);
	barrier_var(total);
}

// ns_nr is a task's id in the innermost PID namespace it sees (a job's own).
static __always_inline __u32 ns_nr(struct pid *p)
{
	int nr = 0;
	if (!p)
		return 0;
	unsigned int level = p->level;
	// numbers[] runs to level; read the entry at a variable index through
	// the probe helper (the verifier allows no variable offset into a
	// kernel structure).
	bpf_probe_read_kernel(&nr, sizeof(nr), (void *)&p->numbers[0] + (level & 31) * sizeof(struct upid));
	return nr;
}

// job_cgroup returns the job cgroup of the current task, 0 if it is not in
// one (then counted in c if count).
static __always_inline __u64 job_cgroup(struct order_counters *c, int count)
{
	__u32 level = job_level;
	if (level == 0) {
		level = find_job_level();
		if (level == 0) {
			if (count)
				c->not_in_job++;
			return 0;
		}
		job_level = level;
	}
	__u64 cgid = bpf_get_current_ancestor_cgroup_id(level);
	if (cgid == 0 && count)
		c->not_in_job++; // a task of the parent itself
	return cgid;
}

// current_key fills k with the current thread's key in job cgroup cgid and
// sets *nspid to its process's id in the job's namespace.
static __always_inline void current_key(struct thread_key *k, __u64 cgid, __u32 *nspid)
{
	struct task_struct *t = bpf_get_current_task_btf();
	k->cgroup_id = cgid;
	k->nstid = ns_nr(t->thread_pid);
	k->pad = 0;
	*nspid = ns_nr(t->group_leader->thread_pid);
}

// current_job_thread fills k (and *nspid) for the current thread if it is a
// task of a job, below the parent cgroup, and returns the counters; NULL if it
// is not (nothing counted).
static __always_inline struct order_counters *current_job_thread(struct thread_key *k, __u32 *nspid)
{
	if (bpf_current_task_under_cgroup(&parent, 0) != 1)
		return 0;
	__u32 zero = 0;
	struct order_counters *c = bpf_map_lookup_elem(&stats, &zero);
	if (!c)
		return 0;
	__u64 cgid = job_cgroup(c, 0);
	if (cgid == 0)
		return 0;
	current_key(k, cgid, nspid);
	return c;
}

// has_children reports whether the caller's process has children. Such a
// process (a launcher, a daemon: mpirun, orted) is never held: the SIGCONT that
// releases it would be forwarded to its children (Open MPI's mpirun and orted
// forward it, and mpirun failed to route it before its daemons were up).
// Children hang off the thread that forked them: the caller and its leader are
// checked.
static __always_inline int has_children(void)
{
	struct task_struct *t = bpf_get_current_task_btf();
	struct task_struct *l = t->group_leader;
	return (unsigned long)t->children.next != (unsigned long)&t->children ||
	       (unsigned long)l->children.next != (unsigned long)&l->children;
}

// stop_result is recv_event.stopped for bpf_send_signal_thread's result: 1
// if the signal was sent, else 2 + the error number.
static __always_inline __u32 stop_result(long sent)
{
	return sent == 0 ? 1 : 2 + (__u32)(-sent);
}

static __always_inline int is_poll_nr(__u32 nr)
{
	for (int i = 0; i < 7; i++)
		if (poll_nr[i] == nr)
			return 1;
	return 0;
}

// pollexit counts the readiness calls of the jobs' threads (struct position)
// and stops a thread whose armed count it reaches.
SEC("tp_btf/sys_exit")
int pollexit(__u64 *ctx)
{
	struct pt_regs *regs = (struct pt_regs *)ctx[0];
	long ret = (long)ctx[1];
	__u32 nr;
	if (bpf_core_field_exists(regs->orig_ax))
		nr = (__u32)regs->orig_ax;
	else
		nr = (__u32)regs->syscallno;
	int restart = nr == restart_nr;
	// Cheapest tests first: every system call of the machine comes here.
	if (!restart && !is_poll_nr(nr))
		return 0;
	struct thread_key k;
	__u32 nspid;
	struct order_counters *c = current_job_thread(&k, &nspid);
	if (!c)
		return 0;
	__u64 cgid = k.cgroup_id;
	struct position *p = bpf_map_lookup_elem(&positions, &k);
	if (!p) {
		if (restart)
			return 0; // restarts something else than a readiness call
		struct position fresh = {};
		if (bpf_map_update_elem(&positions, &k, &fresh, BPF_NOEXIST) != 0 && bpf_map_lookup_elem(&positions, &k) == 0) {
			// Uncounted, the thread's later calls would carry counts that pass for
			// positions and are not: a replay would stop it at the wrong calls,
			// silently. Lost instead, it is a hole in its job's record: a replay
			// across it is refused.
			c->untracked++;
			count_lost(c, cgid);
			return 0;
		}
		p = bpf_map_lookup_elem(&positions, &k);
		if (!p)
			return 0;
	}
	if (restart) {
		if (!p->restart_pending)
			return 0;
		p->restart_pending = 0;
	}
	if (ret == -EINTR || (ret <= -ERESTARTSYS && ret >= -ERESTART_RESTARTBLOCK)) {
		if (ret == -ERESTART_RESTARTBLOCK)
			p->restart_pending = 1;
		return 0;
	}
	// Only the thread itself writes its entry: no atomics needed.
	__u64 polls = p->polls + 1;
	p->polls = polls;
	if (!stops_armed)
		return 0;
	struct stop *s = bpf_map_lookup_elem(&stops, &k);
	if (!s || s->lport != 0 || s->polls != polls)
		return 0;
	long sent = bpf_send_signal_thread(SIGSTOP);
	struct recv_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count_lost(c, cgid);
		return 0;
	}
	__builtin_memset(e, 0, sizeof(*e));
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	e->cgroup_id = cgid;
	e->pid = pid_tgid >> 32;
	e->tid = (__u32)pid_tgid;
	e->nstid = k.nstid;
	e->nspid = nspid;
	e->kind = EV_POLL_STOP;
	e->stopped = stop_result(sent);
	e->polls = polls;
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
	return 0;
}

// posexit frees the position of a job's thread as it exits. An exited thread is in no snapshot, and a job
// that churns threads (a pool, an MPI library's progress threads) would otherwise fill positions with the
// dead and leave its new threads uncounted. sched_process_exit fires in do_exit, in the exiting thread,
// after its last system call: it makes no readiness call (which would put the entry back) nor receive call
// after it, so no live thread's entry is ever dropped.
SEC("tp_btf/sched_process_exit")
int posexit(__u64 *ctx)
{
	struct thread_key k;
	__u32 nspid;
	if (current_job_thread(&k, &nspid))
		bpf_map_delete_elem(&positions, &k);
	return 0;
}

SEC("tp_btf/sock_recv_length")
int recvorder(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	int ret = (int)ctx[1];
	int flags = (int)ctx[2];

	// With positions, a call that found nothing (EAGAIN) is recorded too: a
	// replay must know that the thread looked at the socket there.
	if (ret <= 0 && (ret != -EAGAIN || !positions_on))
		return 0;
	// Cheapest test first: every receive of the machine comes here.
	if (bpf_current_task_under_cgroup(&parent, 0) != 1)
		return 0;

	__u32 zero = 0;
	struct order_counters *c = bpf_map_lookup_elem(&stats, &zero);
	if (!c)
		return 0; // cannot happen: a 1-entry array always has key 0

	__u64 cgid = job_cgroup(c, ret > 0);
	if (cgid == 0)
		return 0;

	if (!sk || sk->sk_protocol != IPPROTO_TCP) {
		if (ret > 0)
			c->non_ipv4++;
		return 0;
	}
	unsigned short family = sk->__sk_common.skc_family;
	if (family == AF_INET6) {
		// IPv4-mapped (::ffff:a.b.c.d): the kernel keeps the IPv4
		// addresses in skc_daddr/skc_rcv_saddr too. The peer's address
		// decides: a dual-stack socket's local address can be ::.
		struct in6_addr *a = &sk->__sk_common.skc_v6_daddr;
		if (a->in6_u.u6_addr32[0] != 0 || a->in6_u.u6_addr32[1] != 0 ||
		    a->in6_u.u6_addr32[2] != bpf_htonl(0xffff)) {
			if (ret > 0)
				c->non_ipv4++;
			return 0;
		}
	} else if (family != AF_INET) {
		if (ret > 0)
			c->non_ipv4++;
		return 0;
	}
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp) {
		if (ret > 0)
			c->non_ipv4++;
		return 0;
	}

	struct recv_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count_lost(c, cgid);
		return 0;
	}
	struct thread_key k = {};
	__u32 nspid = 0;
	struct position *p = 0;
	if (positions_on) {
		current_key(&k, cgid, &nspid);
		p = bpf_map_lookup_elem(&positions, &k);
	}
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	e->cgroup_id = cgid;
	e->laddr = sk->__sk_common.skc_rcv_saddr;
	e->raddr = sk->__sk_common.skc_daddr;
	e->lport = bpf_htons(sk->__sk_common.skc_num);
	e->rport = sk->__sk_common.skc_dport;
	e->copied_seq = tp->copied_seq;
	e->len = ret > 0 ? ret : 0;
	e->flags = flags;
	e->pid = pid_tgid >> 32;
	e->tid = (__u32)pid_tgid;
	e->nstid = k.nstid;
	e->nspid = nspid;
	e->kind = EV_RECV;
	e->stopped = 0;
	e->polls = p ? p->polls : 0;
	__u64 wake = wake_flags(sizeof(*e) + 8);
	// A thread with no readiness call yet has no positions entry and counts 0:
	// a stop armed at 0 (two reads before its first poll) must fire there too.
	if (positions_on && stops_armed) {
		struct stop *s = bpf_map_lookup_elem(&stops, &k);
		if (s && s->lport != 0 && s->lport == e->lport && s->rport == e->rport && s->end == e->copied_seq &&
		    s->len == e->len && s->polls == e->polls) {
			e->stopped = stop_result(bpf_send_signal_thread(SIGSTOP));
			wake = BPF_RB_FORCE_WAKEUP;
		}
	}
	// A peek (or a read of urgent data or the error queue) consumes nothing of
	// the stream, and a socket already closed (its local port reads 0) is of a
	// connection no recovery restores: the agent records no determinant for them.
	if (!e->stopped && ret > 0 && pessimistic_any && !(flags & (MSG_PEEK | MSG_OOB | MSG_ERRQUEUE)) &&
	    e->lport != 0 && e->rport != 0 && !has_children() &&
	    bpf_map_lookup_elem(&pessimistic, &cgid)) {
		e->kind = EV_HELD;
		e->stopped = stop_result(bpf_send_signal_thread(SIGSTOP));
		wake = BPF_RB_FORCE_WAKEUP;
	}
	// A record is 8 bytes of kernel header plus the event, rounded to 8.
	bpf_ringbuf_submit(e, wake);
	c->recorded++;
	return 0;
}
