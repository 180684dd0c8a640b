//go:build ignore

// tcplog.c: sender-side log of the TCP payload bytes of protected flows.
//
// A TCX egress program. For every IPv4 TCP segment with payload that belongs
// to a protected flow it writes one ring buffer record (layout below, decoded
// by netlog.DecodeRecord) holding the whole payload, keyed by TCP sequence
// number. It never modifies a packet. Facts this design rests on are in
// docs/ebpf-logging.md.
//
// Or it parks the segment (park_ifindex below, docs/design.md "The park"):
// a clone of it goes into the park's queue of this CPU and the record holds
// no payload, only the queue.
//
// Lossless by backpressure: when a payload cannot be logged (ring buffer
// full, record larger than the ring, copy error) the segment is dropped
// (TCX_DROP == TC_ACT_SHOT) and counted. TCP retransmits it later and it is
// logged then, so the log never has a hole; it may hold the same bytes twice
// (retransmissions), which the consumer dedupes by sequence range.
//
// What a drop costs the sender, and the two ways it is kept short (both
// measured with `ftbench large-messages`: 2 MB ping-pongs stalled 200-650 ms
// on TCP's timers when the consumer fell a ring behind):
//  - A segment whose bytes all have a record already (a retransmission of
//    logged bytes, below the flow's logged_next in flow_states) is passed
//    unlogged when the ring is full: dropping it would add nothing to the log
//    and cost the sender its retransmission timer again, doubled.
//  - TCP counts a segment its own host dropped as not sent and sends it again
//    when an ACK comes; if none is in flight, only its window probe timer
//    (200 ms at least, then doubling) does. So each drop marks its flow in
//    stalled_flows and raises stalled_pending; the consumer, once half the
//    ring is free again, runs tcplog_kick (iter/tcp), which pushes the
//    queued data of each marked socket at once.
//
// What a long drop costs: TCP gives up on a connection with nothing in
// flight once its own host has dropped 15 window probes in a row
// (tcp_retries2), sent 500 ms apart after a local drop: "connection timed
// out" 7.9 s after the first (measured), while a consumer paused at the log's
// memory cap can leave the ring full for longer (10 s in ci258). So the last
// sixteenth of the ring is a reserve while the consumer is paused at the cap:
// it drains only what keeps the reserve free (ebpfprobes.TCPLogger.ReadPaused),
// and a segment may use it only if its flow has had its segments dropped for
// STALL_RESERVE_NS or more. Each flow held back that long gets one
// segment through every STALL_RESERVE_NS, which resets TCP's count; the log
// grows past its cap by those segments only.
//
// A consumer that takes nothing from the full ring for CONSUMER_GONE_NS, and
// is not paused at the cap (which it says every few milliseconds in
// paused_seen_ns), is gone: its agent stopped, hung or starved. Its segments
// are passed unlogged from then on, and counted (unlogged_passed), as they are
// when an agent exits and its program is detached: the log has a hole there,
// a recovery that needs those bytes is refused (netlog.ErrHole), and the
// receivers' next snapshots close it. Dropping them instead made TCP give up
// on the jobs' connections 8 s later, for a fault of the agent's own.
//
// Which flows are protected:
//  1. bpf_skb_cgroup_id(skb): the cgroup v2 id of the sending socket. This
//     works at TCX egress of the veth inside the sender's network namespace
//     (measured by the end-to-end test: records carry the id of the cgroup
//     the sender was started in): locally generated TCP skbs still own their
//     socket (skb->sk, set by tcp_transmit_skb) until the driver's xmit, and
//     TC egress runs before it. Note the id is the cgroup of the socket, fixed
//     when the socket was created (accepted sockets inherit the listener's),
//     not the cgroup of the thread that writes.
//  2. A map of local ports / exact 4-tuples (also tested end to end), for
//     skbs that carry no socket, where bpf_skb_cgroup_id returns 0. From the
//     kernel source, not measured here: traffic forwarded by this host (a
//     container's packets leaving the host's physical NIC: the skb is
//     orphaned when it crosses the veth into another netns), and packets
//     sent without a full socket (RST/ACK from TIME_WAIT, no payload anyway).
//
// Retransmissions cannot be identified in TC (there is no flag on the skb).
// What we count instead, cheaply, is "seq regressions": logged segments whose
// first sequence number is below the highest logged end for their flow, from
// a small LRU map. That counts RTO/fast retransmits and TLP probes of bytes
// already logged (our own backpressure drops are not logged, so their
// retransmission does not count). The update is not atomic across CPUs: the
// counter is a diagnostic, not an exact number.
//
// Live TCP state per protected flow (flow_states): for EVERY segment of a
// protected flow that leaves through this program (data, pure ACKs, bare
// SYN/FIN/RST, retransmissions) the program records the sender's view in an
// LRU hash keyed by 4-tuple: the highest sequence number sent (snd_nxt), the
// last ACK number (the sender's rcv_nxt), the TCP timestamp option, the raw
// window and flags. The restorer needs the peer's live send state (see
// docs/tcp-relocation.md); fentry/kprobes are refused here
// and TCP_INFO has no sequence numbers, so this is where it can be seen.
// Segments dropped for backpressure were never transmitted and do not update
// the state: every data byte below the recorded snd_nxt has a log record,
// but for those passed unlogged while the consumer was gone (consumer_gone),
// whose hole the log reports to the recovery that reads it.
// The value is updated in place without a lock: TCP transmits a socket's
// segments under its socket lock and TC egress runs synchronously inside
// that transmit, so updates of one flow do not overlap in practice. A segment
// that reaches us late (the neighbour-resolution queue releases packets
// later) cannot move snd_nxt back, a wrap-safe max; it can set an older ack
// and timestamps until the flow's next segment.
//
// IPv4 only, Ethernet framing (optionally one in-frame 802.1Q tag); the Go
// loader refuses non-Ethernet devices. IP fragments of a protected flow cannot
// be logged correctly (later fragments carry no TCP header) and are passed and
// counted: local TCP sets DF, so they appear only if PMTU discovery is off.

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "ringconsumer.h"

#define ETH_HLEN 14
#define VLAN_HLEN 4
#define ETH_P_IP 0x0800
#define ETH_P_8021Q 0x8100
#define IPPROTO_TCP 6
#define IP_MF 0x2000
#define IP_OFFSET 0x1fff
#define BPF_ANY 0
#define BPF_NOEXIST 1

// TCP header flags (byte 13 of the header).
#define TCP_FIN 0x01
#define TCP_SYN 0x02
#define TCP_RST 0x04
#define TCP_ACK 0x10

#define TCPOPT_EOL 0
#define TCPOPT_NOP 1
#define TCPOPT_TIMESTAMP 8
#define TCPOLEN_TIMESTAMP 10
#define TCP_MAX_OPTLEN 40 // doff is 4 bits: at most 60 - 20 bytes of options

// flow_state.seen: facts about the flow that stay set once seen.
#define SEEN_SYN 0x01 // isn is valid: this entry started at the flow's SYN
#define SEEN_ACK 0x02 // ack is valid
#define SEEN_TS 0x04  // tsval/tsecr are valid
#define SEEN_FIN 0x08 // the sender sent a FIN
#define SEEN_RST 0x10 // the sender sent a RST
#define SEEN_LOGGED 0x20 // logged_next is valid: the entry started at the SYN
#define SEEN_LONG 0x40   // the logged prefix is 2^31 bytes or longer (see all_logged)

// Pass: TCX_NEXT lets programs attached after us run and decide; if there is
// none the packet is sent (same as TC_ACT_OK).
#define VERDICT_PASS ((int)TCX_NEXT)
// Drop for backpressure: TCX_DROP is TC_ACT_SHOT.
#define VERDICT_DROP ((int)TCX_DROP)

char __license[] SEC("license") = "Dual BSD/GPL";

// The record header. Exact little-endian layout, packed (36 bytes, no padding),
// followed by len payload bytes. netlog.DecodeRecord decodes exactly this:
// change both together.
struct record_hdr {
	__be32 saddr;     // network byte order, as in the IP header
	__be32 daddr;     // network byte order
	__be16 sport;     // network byte order, as in the TCP header
	__be16 dport;     // network byte order
	__u32 seq;        // host order: sequence number of the first payload byte
	__u32 len;        // payload length
	__u64 cgroup_id;  // bpf_skb_cgroup_id, 0 when the skb has no socket
	__u64 ktime_ns;   // bpf_ktime_get_ns at logging
} __attribute__((packed));

_Static_assert(sizeof(struct record_hdr) == 36, "record header must be 36 bytes");

// flow_key is the key of protected_flows and flow_high. In protected_flows a
// key with only sport set (saddr, daddr, dport zero) protects a local port.
struct flow_key {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
};

// flow_state is the value of flow_states: the sender's live TCP state as
// seen on its egress. ebpfprobes.FlowState documents it for its users.
struct flow_state {
	__u32 snd_nxt;  // highest seq + payload + SYN + FIN transmitted (wrap-safe max)
	__u32 ack;      // ACK number of the last segment with ACK: the sender's rcv_nxt
	__u32 tsval;    // timestamp option of the last segment that had one
	__u32 tsecr;
	__u32 isn;      // sequence number of the SYN (valid with SEEN_SYN)
	__u16 window;   // raw window field of the last segment, unscaled
	__u8 flags;     // TCP flags of the last segment
	__u8 seen;      // SEEN_* bits
	__u64 ktime_ns; // bpf_ktime_get_ns (CLOCK_MONOTONIC) of the last update
	__u64 segments; // segments seen since the entry was created
	// With SEEN_LOGGED: every payload byte from isn + 1 up to logged_next has
	// a record (the contiguous logged prefix; a segment logged after a hole,
	// possible for forwarded flows, does not raise it). Not SEEN_LOGGED when
	// the entry did not start at the SYN: nothing is known then.
	__u32 logged_next;
	__u32 reserved;
};

_Static_assert(sizeof(struct flow_state) == 48, "flow_state must have no padding");

// Per-CPU counters; the loader sums them over CPUs.
struct counters {
	__u64 packets_logged;     // records written
	__u64 bytes_logged;       // payload bytes written
	__u64 drops_backpressure; // dropped: ring buffer had no room
	__u64 drops_oversize;     // dropped: record can never fit the ring (grow the ring!)
	__u64 drops_error;        // dropped: dynptr setup/copy failed
	__u64 seq_regressions;    // logged segments starting below the flow's highest logged end
	__u64 fragments_passed;   // IP fragments of a protected socket, not logged
	__u64 headers_pulled;     // segments whose headers were made linear before the copy
	__u64 logged_passed;      // ring full, passed unlogged: every byte had a record already
	__u64 kicks;              // sockets tcplog_kick pushed after a drop
	__u64 reserve_logged;     // segments of flows stalled STALL_RESERVE_NS or more, logged into the reserve
	__u64 unlogged_passed;    // ring full and its consumer gone: passed unlogged (a hole in the log)
	__u64 packets_parked;     // segments cloned into the park, a header record in the ring
	__u64 bytes_parked;       // their payload bytes
	__u64 park_failed;        // the park refused a clone (its queue full): the segment was copied instead
	__u64 park_full;          // the park held park_cap bytes: the segment was copied instead
};

// A flow whose segments have been dropped this long may use the ring's reserve.
#define STALL_RESERVE_NS 2000000000ULL
// The reserve is the last 1/2^RESERVE_SHIFT of the ring (ebpfprobes.reserveShift).
#define RESERVE_SHIFT 4

// Set by the loader before load: the ring buffer size in bytes.
volatile const __u32 ring_size = 0;
// Set by the loader before load: while the consumer is polling, wake it only
// when the ring's fill crosses this many bytes.
volatile const __u32 wake_bytes = 0;

// Written by the consumer (mmapped .bss): nonzero while it is draining the
// ring and polls it on a short timer by itself (ring_wake_flags). When the
// consumer goes idle it clears the flag and the kernel's default wakes it on
// the next record.
volatile __u32 consumer_polling = 0;

// Written by the consumer (mmapped .bss): nonzero while it is paused at the
// log's memory cap and drains only what keeps the ring's reserve free: only
// then do other segments leave the reserve to flows held back long.
volatile __u32 consumer_paused = 0;
// Written by the paused consumer at each look at the ring (bpf_ktime_get_ns's
// clock, CLOCK_MONOTONIC): it is alive, though it takes nothing.
volatile __u64 paused_seen_ns = 0;

// The consumer's position in the ring when a drop last found it moved, and
// when (ring_consumer_stuck).
volatile __u64 cons_seen = 0;
volatile __u64 cons_seen_ns = 0;

// The park (netlog/park, docs/design.md): a tap device with park_buckets
// queues per CPU, one for each bucket of destination addresses
// (park_bucket). A segment of park_min..park_max payload bytes is cloned into
// queue cpu * park_buckets + its bucket, if below park_queues
// (bpf_clone_redirect: the clone shares the segment's pages, no byte is
// copied; the park's steering program takes the queue from the clone's mark),
// and only its header goes into the ring, naming the queue. A queue's clones
// come out in the order this CPU parked them, which is the order of its
// records in the ring: the consumer knows which clone is next in each queue
// and reads either its headers only (its bytes are no longer needed) or all
// of it (into the log). A recovery that needs one destination's bytes reads
// only that bucket's queues. park_ifindex 0: nothing is parked.
volatile const __u32 park_ifindex = 0;
volatile const __u32 park_queues = 0;
volatile const __u32 park_buckets = 1; // a power of 2
volatile const __u32 park_min = 0;
volatile const __u32 park_max = 0;
// Payload bytes parked so far (the program's, atomic) and freed or taken out
// of the park (the consumer's): at most park_cap bytes wait at a time (the
// consumer sets it; 0 parks nothing), give or take the segments of CPUs that
// checked at once.
volatile __u64 parked_total = 0;
volatile __u64 parked_freed = 0;
volatile __u64 park_cap = 0;

#define PARKED_FLAG 0x80000000U

// A parked record: the header, with PARKED_FLAG in len, and the queue.
struct park_record {
	struct record_hdr hdr;
	__u32 queue;
} __attribute__((packed));

_Static_assert(sizeof(struct park_record) == 40, "park record must be 40 bytes");

// Set by the program when it drops a segment for backpressure (its flow is
// then in stalled_flows); the consumer clears it before it runs tcplog_kick.
volatile __u32 stalled_pending = 0;

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 24); // the loader overrides this
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);  // cgroup v2 id (the cgroup directory's inode number)
	__type(value, __u8); // unused
} protected_cgroups SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct flow_key);
	__type(value, __u8); // unused
} protected_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct flow_key);
	__type(value, __u32); // highest logged end sequence number (seq + len)
} flow_high SEC(".maps");

// Flows with a segment dropped for backpressure since tcplog_kick last ran or
// the flow last logged into the reserve. LRU: a flow evicted before the kick
// waits for TCP's own timer, as before.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct flow_key);
	__type(value, __u64); // bpf_ktime_get_ns of the first of these drops
} stalled_flows SEC(".maps");

// LRU: only protected flows get an entry, so one is evicted only when more
// than max_entries protected flows were active since it was last updated.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, struct flow_key);
	__type(value, struct flow_state);
} flow_states SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct counters);
} stats SEC(".maps");

// kfuncs: bpftool 7.1's vmlinux.h has no prototypes for them.
extern int bpf_dynptr_from_skb(struct __sk_buff *skb, __u64 flags,
			       struct bpf_dynptr *ptr__uninit) __ksym;
extern int bpf_dynptr_copy(struct bpf_dynptr *dst_ptr, __u32 dst_off,
			   struct bpf_dynptr *src_ptr, __u32 src_off, __u32 size) __ksym;

static __always_inline struct counters *get_counters(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&stats, &zero);
}

static __always_inline int is_protected(__u64 cgid, struct flow_key *fk)
{
	if (cgid && bpf_map_lookup_elem(&protected_cgroups, &cgid))
		return 1;
	if (bpf_map_lookup_elem(&protected_flows, fk))
		return 1;
	struct flow_key port = { .sport = fk->sport };
	return bpf_map_lookup_elem(&protected_flows, &port) != 0;
}

// note_seq counts a sequence regression and raises the flow's highest end.
static __always_inline void note_seq(struct counters *c, struct flow_key *fk, __u32 seq, __u32 len)
{
	__u32 end = seq + len;
	__u32 *high = bpf_map_lookup_elem(&flow_high, fk);
	if (!high) {
		bpf_map_update_elem(&flow_high, fk, &end, BPF_ANY);
		return;
	}
	if ((__s32)(seq - *high) < 0)
		c->seq_regressions++;
	if ((__s32)(end - *high) > 0)
		*high = end;
}

// wake_flags returns the submit flags for a record of need ring bytes.
static __always_inline __u64 wake_flags(__u64 need)
{
	return ring_wake_flags(&events, consumer_polling, wake_bytes, need);
}

// OPTBUF is the size of the options buffer: a power of two above 40 so that
// masking an index with OPTBUF - 1 proves it in bounds to the verifier
// whatever clang does with the explicit checks (clang 14 tests one copy of
// the index and then indexes with another register the verifier knows
// nothing about).
#define OPTBUF 64
#define OPT(opts, i) ((opts)[(i) & (OPTBUF - 1)])

// opt_walk is the state of the general option walk, shared with the
// bpf_loop callback.
struct opt_walk {
	__u8 opts[OPTBUF]; // zeroed, then the option bytes
	__u32 optlen;      // option bytes present, <= TCP_MAX_OPTLEN
	__u32 i;           // offset of the next option
	__u32 tsval;
	__u32 tsecr;
	__u32 found;
};

static __always_inline __u32 opt_be32(const __u8 *opts, __u32 i)
{
	return (__u32)OPT(opts, i) << 24 | (__u32)OPT(opts, i + 1) << 16 |
	       (__u32)OPT(opts, i + 2) << 8 | OPT(opts, i + 3);
}

// opt_step examines the option at w->i; it returns 1 to stop the walk.
static long opt_step(__u64 index, void *ctx)
{
	struct opt_walk *w = ctx;
	__u32 i = w->i;

	if (i >= w->optlen)
		return 1;
	__u8 kind = OPT(w->opts, i);
	if (kind == TCPOPT_EOL)
		return 1;
	if (kind == TCPOPT_NOP) {
		w->i = i + 1;
		return 0;
	}
	if (i + 1 >= w->optlen)
		return 1; // the length byte is missing
	__u8 olen = OPT(w->opts, i + 1);
	if (olen < 2 || i + olen > w->optlen)
		return 1; // malformed: stop, as the kernel does
	if (kind == TCPOPT_TIMESTAMP && olen == TCPOLEN_TIMESTAMP) {
		w->tsval = opt_be32(w->opts, i + 2);
		w->tsecr = opt_be32(w->opts, i + 6);
		w->found = 1;
		return 1;
	}
	w->i = i + olen; // other options, and a TS of the wrong size, are skipped
	return 0;
}

// parse_timestamp finds the TCP timestamp option among the optlen (0..40)
// option bytes at offset off. It returns 1 and the values when found, 0 when
// absent or when the options are malformed before it. The walk follows the
// kernel's tcp_parse_options, except that it stops at the first timestamp
// option where the kernel keeps the last (Linux never sends two).
static __always_inline int parse_timestamp(struct __sk_buff *skb, __u32 off, __u32 optlen,
					   __u32 *tsval, __u32 *tsecr)
{
	struct opt_walk w = {};

	if (optlen < TCPOLEN_TIMESTAMP || optlen > TCP_MAX_OPTLEN)
		return 0;
	if (bpf_skb_load_bytes(skb, off, w.opts, optlen))
		return 0;
	// Fast path: Linux sends NOP, NOP, TS first on every established segment.
	if (w.opts[0] == TCPOPT_NOP && w.opts[1] == TCPOPT_NOP &&
	    w.opts[2] == TCPOPT_TIMESTAMP && w.opts[3] == TCPOLEN_TIMESTAMP && optlen >= 12) {
		*tsval = opt_be32(w.opts, 4);
		*tsecr = opt_be32(w.opts, 8);
		return 1;
	}
	// General walk (SYNs: MSS, SACK-permitted, TS, NOP, window scale). Each
	// step advances i by at least 1, so 40 steps cover 40 bytes. bpf_loop
	// has the verifier check the step once; an open-coded loop made it
	// explore every path through 40 iterations (over 1M instructions).
	w.optlen = optlen;
	bpf_loop(TCP_MAX_OPTLEN, opt_step, &w, 0);
	if (!w.found)
		return 0;
	*tsval = w.tsval;
	*tsecr = w.tsecr;
	return 1;
}

// update_flow_state records one transmitted segment of a protected flow;
// logged says whether its len payload bytes were just logged.
static __always_inline void update_flow_state(struct flow_key *fk, struct tcphdr *tcp, __u32 len, int logged,
					      int has_ts, __u32 tsval, __u32 tsecr)
{
	__u8 flags = ((__u8 *)tcp)[13];
	__u32 seq = bpf_ntohl(tcp->seq);
	// SYN and FIN each occupy one sequence number. A RST never raises
	// snd_nxt: one sent for a stray segment carries that segment's ACK
	// number as its seq, which says nothing about what was sent.
	__u32 end = seq + len + !!(flags & TCP_SYN) + !!(flags & TCP_FIN);
	__u64 now = bpf_ktime_get_ns();

	struct flow_state *st = bpf_map_lookup_elem(&flow_states, fk);
	// A SYN with a new ISN starts a new connection on this 4-tuple: forget
	// the old one. A retransmitted SYN (same ISN) is an ordinary update.
	if (!st || ((flags & TCP_SYN) && (!(st->seen & SEEN_SYN) || st->isn != seq))) {
		struct flow_state fresh = {
			.snd_nxt = (flags & TCP_RST) ? seq : end,
			.window = bpf_ntohs(tcp->window),
			.flags = flags,
			.ktime_ns = now,
			.segments = 1,
		};
		if (flags & TCP_SYN) {
			fresh.isn = seq;
			// Payload of a SYN (TCP Fast Open) is left out of logged_next:
			// it errs on the side of logging.
			fresh.logged_next = seq + 1;
			fresh.seen |= SEEN_SYN | SEEN_LOGGED;
		}
		if (flags & TCP_ACK) {
			fresh.ack = bpf_ntohl(tcp->ack_seq);
			fresh.seen |= SEEN_ACK;
		}
		if (has_ts) {
			fresh.tsval = tsval;
			fresh.tsecr = tsecr;
			fresh.seen |= SEEN_TS;
		}
		if (flags & TCP_FIN)
			fresh.seen |= SEEN_FIN;
		if (flags & TCP_RST)
			fresh.seen |= SEEN_RST;
		bpf_map_update_elem(&flow_states, fk, &fresh, BPF_ANY);
		return;
	}

	// Serial-number arithmetic (RFC 1982): end is after snd_nxt when the
	// signed 32-bit distance is positive, across the 2^32 wrap too.
	// Retransmissions end at or before snd_nxt and leave it alone.
	if (!(flags & TCP_RST) && (__s32)(end - st->snd_nxt) > 0)
		st->snd_nxt = end;
	// The logged prefix grows only by a logged segment that starts inside it.
	__u32 data_seq = seq + !!(flags & TCP_SYN); // a SYN's payload starts after it
	__u32 data_end = data_seq + len;
	__u8 seen = st->seen;
	if (logged && len && (seen & SEEN_LOGGED) && (__s32)(data_seq - st->logged_next) <= 0 &&
	    (__s32)(data_end - st->logged_next) > 0) {
		st->logged_next = data_end;
		if ((__s32)(data_end - (st->isn + 1)) < 0)
			seen |= SEEN_LONG; // half the sequence space logged: see all_logged
	}
	if (flags & TCP_ACK) {
		st->ack = bpf_ntohl(tcp->ack_seq);
		seen |= SEEN_ACK;
	}
	if (has_ts) {
		st->tsval = tsval;
		st->tsecr = tsecr;
		seen |= SEEN_TS;
	}
	if (flags & TCP_FIN)
		seen |= SEEN_FIN;
	if (flags & TCP_RST)
		seen |= SEEN_RST;
	st->seen = seen;
	st->window = bpf_ntohs(tcp->window);
	st->flags = flags;
	st->ktime_ns = now;
	st->segments++;
}

// all_logged reports whether every payload byte of [seq, seq + len) of the
// flow has a record already (see flow_state.logged_next). The segment must
// end at or before logged_next and start in the logged prefix: at or after
// isn + 1 while the prefix is shorter than 2^31 bytes (serial arithmetic
// cannot order points further apart), and within 2^31 bytes before
// logged_next once it is longer, where that is all of the prefix TCP can
// still send (its window is at most 2^30).
static __always_inline int all_logged(struct flow_key *fk, __u32 seq, __u32 len)
{
	struct flow_state *st = bpf_map_lookup_elem(&flow_states, fk);
	if (!st || !(st->seen & SEEN_LOGGED))
		return 0;
	if ((__s32)(seq + len - st->logged_next) > 0)
		return 0;
	if (st->seen & SEEN_LONG)
		return (__s32)(st->logged_next - seq) > 0;
	return (__s32)(seq - (st->isn + 1)) >= 0;
}

// ring_room says whether a record of need ring bytes may be reserved for
// flow fk now (1), or may only go into the reserve, which fk has earned by
// being held back STALL_RESERVE_NS (2), or neither (0). The reserve is kept
// only while the consumer is paused.
static __always_inline int ring_room(struct flow_key *fk, __u64 need, __u64 now)
{
	if (!consumer_paused ||
	    bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) + need + (ring_size >> RESERVE_SHIFT) <= ring_size)
		return 1;
	__u64 *since = bpf_map_lookup_elem(&stalled_flows, fk);
	if (since && (__s64)(now - *since) >= (__s64)STALL_RESERVE_NS)
		return 2;
	return 0;
}

// consumer_gone says whether the ring's consumer has taken nothing for
// CONSUMER_GONE_NS while not paused at the cap (see cons_seen).
static __always_inline int consumer_gone(__u64 now)
{
	if (!ring_consumer_stuck(&events, &cons_seen, &cons_seen_ns, now))
		return 0;
	return !consumer_paused || (__s64)(now - paused_seen_ns) >= (__s64)CONSUMER_GONE_NS;
}

// ring_full is the verdict on a segment that found no room in the ring: it
// passes if its bytes all have a record already, or unlogged if the consumer
// is gone, else it is dropped and its flow marked stalled (since now, unless
// it already was).
static __always_inline int ring_full(struct counters *c, struct flow_key *fk, struct tcphdr *tcp, __u32 seq,
				     __u32 len, __u64 now, int has_ts, __u32 tsval, __u32 tsecr)
{
	if (all_logged(fk, seq, len)) {
		c->logged_passed++;
		update_flow_state(fk, tcp, len, 0, has_ts, tsval, tsecr);
		return VERDICT_PASS;
	}
	if (consumer_gone(now)) {
		c->unlogged_passed++;
		update_flow_state(fk, tcp, len, 0, has_ts, tsval, tsecr);
		return VERDICT_PASS;
	}
	c->drops_backpressure++;
	bpf_map_update_elem(&stalled_flows, fk, &now, BPF_NOEXIST);
	stalled_pending = 1;
	return VERDICT_DROP;
}

// park_bucket is the bucket of destination address daddr: the XOR of its
// four bytes, modulo park_buckets (netlog/park.Bucket, which must agree).
static __always_inline __u32 park_bucket(__be32 daddr)
{
	__u32 a = daddr;
	a ^= a >> 16;
	a ^= a >> 8;
	return a & 0xff & (park_buckets - 1);
}

// park_segment parks the segment hdr describes (see park_ifindex): 1 if it
// did, 0 if the segment must be copied into the ring instead, -1 if the ring
// has no room even for the header (the caller's ring_full decides then).
static __always_inline int park_segment(struct __sk_buff *skb, struct counters *c, struct flow_key *fk,
					struct record_hdr *hdr)
{
	__u32 len = hdr->len;
	if (!park_ifindex || len < park_min || len > park_max)
		return 0;
	__u32 queue = bpf_get_smp_processor_id() * park_buckets + park_bucket(fk->daddr);
	if (queue >= park_queues)
		return 0;
	if (parked_total - parked_freed + len > park_cap) {
		c->park_full++;
		return 0;
	}
	__u64 need = (sizeof(struct park_record) + 8 + 7) & ~7ULL;
	int room = ring_room(fk, need, hdr->ktime_ns);
	if (!room)
		return -1;
	struct park_record *r = bpf_ringbuf_reserve(&events, sizeof(*r), 0);
	if (!r)
		return -1;
	__builtin_memcpy(&r->hdr, hdr, sizeof(*hdr));
	r->hdr.len = len | PARKED_FLAG;
	r->queue = queue;
	// The clone goes out of the park's egress into the queue its mark names
	// (the steering program's answer); with no qdisc on the park, a full
	// queue fails the call. The segment itself keeps its own mark.
	__u32 mark = skb->mark;
	skb->mark = queue;
	int err = bpf_clone_redirect(skb, park_ifindex, 0);
	skb->mark = mark;
	if (err) {
		bpf_ringbuf_discard(r, 0);
		c->park_failed++;
		return 0;
	}
	bpf_ringbuf_submit(r, wake_flags(need));
	__sync_fetch_and_add(&parked_total, len);
	if (room == 2) {
		bpf_map_delete_elem(&stalled_flows, fk);
		c->reserve_logged++;
	}
	c->packets_parked++;
	c->bytes_parked += len;
	return 1;
}

SEC("tcx/egress")
int tcplog_egress(struct __sk_buff *skb)
{
	// An in-frame 802.1Q tag makes skb->protocol ETH_P_8021Q (a hardware
	// accelerated one leaves it ETH_P_IP): the frame's own type decides below.
	if (skb->protocol != bpf_htons(ETH_P_IP) && skb->protocol != bpf_htons(ETH_P_8021Q))
		return VERDICT_PASS;

	// Headers are read with bpf_skb_load_bytes, which works whether or not
	// they sit in the linear part of the skb.
	__u32 nh = ETH_HLEN;
	__be16 proto;
	if (bpf_skb_load_bytes(skb, 12, &proto, sizeof(proto)))
		return VERDICT_PASS;
	if (proto == bpf_htons(ETH_P_8021Q)) {
		if (bpf_skb_load_bytes(skb, 16, &proto, sizeof(proto)))
			return VERDICT_PASS;
		nh += VLAN_HLEN;
	}
	if (proto != bpf_htons(ETH_P_IP))
		return VERDICT_PASS;

	struct iphdr ip;
	if (bpf_skb_load_bytes(skb, nh, &ip, sizeof(ip)))
		return VERDICT_PASS;
	if (ip.version != 4 || ip.ihl < 5 || ip.protocol != IPPROTO_TCP)
		return VERDICT_PASS;
	__u32 iphl = ip.ihl * 4;

	__u64 cgid = bpf_skb_cgroup_id(skb);
	if (ip.frag_off & bpf_htons(IP_MF | IP_OFFSET)) {
		if (cgid && bpf_map_lookup_elem(&protected_cgroups, &cgid)) {
			struct counters *c = get_counters();
			if (c)
				c->fragments_passed++;
		}
		return VERDICT_PASS;
	}

	struct tcphdr tcp;
	if (bpf_skb_load_bytes(skb, nh + iphl, &tcp, sizeof(tcp)))
		return VERDICT_PASS;
	__u32 tcphl = tcp.doff * 4;
	if (tcphl < sizeof(tcp))
		return VERDICT_PASS;

	// The IP length, not skb->len, bounds the payload; BIG TCP GSO packets
	// (> 64 KiB) carry tot_len 0 and are sized from skb->len.
	__u32 iplen = bpf_ntohs(ip.tot_len);
	if (iplen == 0)
		iplen = skb->len - nh;
	if (iplen < iphl + tcphl || nh + iplen > skb->len)
		return VERDICT_PASS; // malformed
	__u32 len = iplen - iphl - tcphl; // 0 for pure ACKs and bare SYN/FIN/RST
	__u32 off = nh + iphl + tcphl;

	struct flow_key fk = {
		.saddr = ip.saddr,
		.daddr = ip.daddr,
		.sport = tcp.source,
		.dport = tcp.dest,
	};
	if (!is_protected(cgid, &fk))
		return VERDICT_PASS;

	__u32 tsval = 0, tsecr = 0;
	int has_ts = parse_timestamp(skb, nh + iphl + sizeof(tcp), tcphl - sizeof(tcp), &tsval, &tsecr);
	if (len == 0) {
		update_flow_state(&fk, &tcp, 0, 0, has_ts, tsval, tsecr);
		return VERDICT_PASS;
	}

	struct counters *c = get_counters();
	if (!c)
		return VERDICT_PASS; // cannot happen: a 1-entry array always has key 0

	// The ring holds a record plus its 8-byte kernel header, rounded up to 8;
	// a bigger one can never be reserved and its segment would be dropped
	// forever. Count it apart so the stall has a name.
	__u64 need = ((__u64)sizeof(struct record_hdr) + len + 8 + 7) & ~7ULL;
	if (need > ring_size) {
		c->drops_oversize++;
		return VERDICT_DROP;
	}

	struct record_hdr hdr = {
		.saddr = ip.saddr,
		.daddr = ip.daddr,
		.sport = tcp.source,
		.dport = tcp.dest,
		// A SYN occupies its own sequence number: the payload of a SYN
		// (TCP Fast Open, tcp_send_syn_data) starts after it.
		.seq = bpf_ntohl(tcp.seq) + !!(((__u8 *)&tcp)[13] & TCP_SYN),
		.len = len,
		.cgroup_id = cgid,
		.ktime_ns = bpf_ktime_get_ns(),
	};

	int parked = park_segment(skb, c, &fk, &hdr);
	if (parked < 0)
		return ring_full(c, &fk, &tcp, hdr.seq, len, hdr.ktime_ns, has_ts, tsval, tsecr);
	if (parked) {
		note_seq(c, &fk, hdr.seq, len);
		update_flow_state(&fk, &tcp, len, 1, has_ts, tsval, tsecr);
		return VERDICT_PASS;
	}

	// bpf_dynptr_copy from an offset past the skb's linear part copies the
	// memory after it, not the packet (Linux 6.18: skb_pointer_if_linear's
	// unsigned compare wraps; docs/ebpf-logging.md). A segment this host sent
	// has its headers linear, but a forwarded one (a job namespace's or a
	// container's traffic) can hold its TCP options in page fragments, where
	// the receive path pulled only the base headers: pull them first.
	if ((long)skb->data + off > (long)skb->data_end) {
		if (bpf_skb_pull_data(skb, off)) {
			c->drops_error++;
			return VERDICT_DROP;
		}
		c->headers_pulled++;
	}

	int room = ring_room(&fk, need, hdr.ktime_ns);
	if (!room)
		return ring_full(c, &fk, &tcp, hdr.seq, len, hdr.ktime_ns, has_ts, tsval, tsecr);
	struct bpf_dynptr rec, pkt;
	if (bpf_ringbuf_reserve_dynptr(&events, sizeof(hdr) + len, 0, &rec)) {
		// The verifier wants the failed dynptr released too.
		bpf_ringbuf_discard_dynptr(&rec, 0);
		return ring_full(c, &fk, &tcp, hdr.seq, len, hdr.ktime_ns, has_ts, tsval, tsecr);
	}
	// One copy from the skb (linear part and page frags alike) straight
	// into the reserved record.
	if (bpf_dynptr_write(&rec, 0, &hdr, sizeof(hdr), 0) ||
	    bpf_dynptr_from_skb(skb, 0, &pkt) ||
	    bpf_dynptr_copy(&rec, sizeof(hdr), &pkt, off, len)) {
		bpf_ringbuf_discard_dynptr(&rec, 0);
		c->drops_error++;
		return VERDICT_DROP;
	}
	bpf_ringbuf_submit_dynptr(&rec, wake_flags(need));
	if (room == 2) {
		// Its next drop starts its wait for the reserve again.
		bpf_map_delete_elem(&stalled_flows, &fk);
		c->reserve_logged++;
	}

	c->packets_logged++;
	c->bytes_logged += len;
	note_seq(c, &fk, hdr.seq, len);
	update_flow_state(&fk, &tcp, len, 1, has_ts, tsval, tsecr);
	return VERDICT_PASS;
}

// The kernel structures tcplog_kick reads, reduced to the fields read: the
// trimmed vmlinux.h does not have them, and preserve_access_index relocates
// each field by name against the running kernel's BTF (as in recvorder.c).
struct sock_common {
	__be32 skc_daddr;     // remote address
	__be32 skc_rcv_saddr; // local address
	__be16 skc_dport;     // remote port, network order
	__u16 skc_num;        // local port, host order
} __attribute__((preserve_access_index));

struct tcp_sock {
	__u32 snd_nxt;   // the next byte to send
	__u32 write_seq; // the byte after the last one the application wrote
} __attribute__((preserve_access_index));

struct bpf_iter_meta {
	void *seq;
} __attribute__((preserve_access_index));

struct bpf_iter__tcp {
	struct bpf_iter_meta *meta;
	struct sock_common *sk_common;
} __attribute__((preserve_access_index));

#define SOL_TCP 6
#define TCP_NODELAY 1

// tcplog_kick runs over the TCP sockets of the network namespace its
// iterator was opened in. A socket whose flow is in stalled_flows, with data
// queued and not sent, has its queue pushed now: setting TCP_NODELAY does
// that (tcp_push_pending_frames), and it is set back when it was off, so the
// application's Nagle setting is as before (what stays is TCP_NAGLE_PUSH,
// which the kernel clears at the application's next write: only the data
// already queued goes out at once, as it would have without the drop).
SEC("iter/tcp")
int tcplog_kick(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0; // a request or TIME_WAIT socket
	struct flow_key fk = {
		.saddr = skc->skc_rcv_saddr,
		.daddr = skc->skc_daddr,
		.sport = bpf_htons(skc->skc_num),
		.dport = skc->skc_dport,
	};
	if (!bpf_map_lookup_elem(&stalled_flows, &fk))
		return 0;
	bpf_map_delete_elem(&stalled_flows, &fk);
	if (tp->write_seq == tp->snd_nxt)
		return 0; // sent meanwhile: nothing waits
	int was = 0, on = 1;
	if (bpf_getsockopt(tp, SOL_TCP, TCP_NODELAY, &was, sizeof(was)))
		return 0;
	if (bpf_setsockopt(tp, SOL_TCP, TCP_NODELAY, &on, sizeof(on)))
		return 0;
	if (!was)
		bpf_setsockopt(tp, SOL_TCP, TCP_NODELAY, &was, sizeof(was));
	struct counters *c = get_counters();
	if (c)
		c->kicks++;
	return 0;
}
