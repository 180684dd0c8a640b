//go:build ignore

// tcprecv.c: receive-side tap of the TCP payload bytes of protected sockets.
//
// A cgroup_skb/ingress program, attached to the cgroups of protected jobs. It
// runs in tcp_v4_rcv (tcp_filter) after the socket lookup and before TCP
// processes the segment, for every segment addressed to a socket of the
// cgroup or its descendants; the skb data starts at the IP header. For every
// payload byte the socket's TCP can accept it writes a ring buffer record in
// exactly tcplog.c's format (decoded by netlog.DecodeRecord): saddr/sport are
// the remote sender as in the headers, daddr/dport the local receiver.
//
// What the records of one flow guarantee: every byte TCP accepts is in a
// record submitted before TCP saw it: once a consumer has drained the ring
// after reading a socket's rcv_nxt, it holds every byte below that rcv_nxt
// from its flow's first record on. Records come in sequence order except
// where the network reordered or lost segments: a segment past a hole is
// recorded as it arrives, before the retransmission that fills the hole, so
// a consumer holds such records until the hole is filled. Records may
// also hold bytes TCP then discarded (receive buffer full, another program's
// verdict): their retransmission carries the same bytes and passes as a
// duplicate. They may hold the same bytes twice (races below).
//
// Per flow, rx_flows keeps rx_next, the next byte expected: every byte before
// it has been recorded. A segment [seq, end) with payload:
//   - end <= rx_next: bytes recorded before (a retransmission): pass.
//   - seq == rx_next: record it, advance rx_next to end, pass.
//   - seq < rx_next < end: record it whole, advance rx_next to end, pass.
//     Its first bytes were recorded before, from another copy (a
//     retransmission of bytes the socket discarded, a late original, a race
//     with another CPU); a consumer skips them or compares them. It is
//     copied from its first payload byte, never from rx_next: a copy from an
//     skb dynptr at an offset past the skb's linear part reads other memory
//     on Linux 6.18 (docs/ebpf-logging.md, "Copies past the linear part").
//   - seq > rx_next: there is a hole before it (loss, reordering): record it
//     whole, pass it, leave rx_next (the hole is still there). TCP keeps it
//     in its out-of-order queue and accepts it once a retransmission fills
//     the hole, and that retransmission is recorded then. Dropping it
//     instead, the first design, cost the sender's retransmission timer for
//     every reordered segment (the segments after it dropped too, so no
//     duplicate ACKs): a veth (the lab) delivers each segment on the CPU that
//     sent it, and a flow is sent from the writer's CPU and from where its
//     ACKs are processed, so there reordering is frequent: 0.35 of the
//     untapped throughput, measured. rx_next catches up with the bytes TCP
//     took from its out-of-order queue by the resync below.
//   - recording fails (ring full, copy error, record larger than the ring):
//     drop, leave rx_next, count. TCP retransmits (lossless by backpressure,
//     as in tcplog.c).
//
// The live rcv_nxt of the socket never decides a drop: segments queued to the
// socket backlog while the user holds the socket lock have passed us but not
// advanced rcv_nxt yet, so it lags behind rx_next.
//
// Where rx_next comes from:
//   - A SYN received by a listener or by a socket in SYN_SENT (the SYN-ACK)
//     starts the flow: rx_next = ISN + 1, exact, and a record without
//     payload at ISN + 1 tells the consumer where the flow's bytes begin.
//     It is in the ring before any of the flow's data (the peer sends none
//     before this SYN is answered), so a data record that reaches the ring
//     ahead of an earlier one (two CPUs, the veth) is held by the consumer
//     as past a hole, not taken as the flow's first byte. A SYN that reaches a
//     synchronized socket changes nothing (TCP answers with a challenge ACK
//     and accepts none of its bytes), and its payload is not recorded.
//   - Otherwise (the connection predates the attach, the entry was evicted
//     from the LRU or belongs to another socket on the same 4-tuple) from
//     the socket's rcv_nxt: bytes accepted before are not covered.
//   - Resync: when the socket's rcv_nxt is after rx_next, TCP accepted bytes
//     that were never recorded (segments that passed before the attach and
//     sat in the backlog, or an entry re-created from an older rcv_nxt) and
//     nothing can bring them back: rx_next is raised to rcv_nxt and the
//     resync is counted. Without it the flow would stall forever (every
//     segment after rx_next dropped as out of order). A consumer sees a real
//     hole as a record that starts after the bytes it has.
//
// The entry remembers the receiving socket's cookie, so an entry left by an
// earlier connection on the same 4-tuple is never mistaken for this one's. A
// listener's SYN leaves cookie 0: the accepted child adopts the entry.
//
// Concurrency: cgroup_skb runs without the socket lock, so two CPUs may
// handle segments of one flow at once. rx_next is only ever raised, with a
// compare-and-swap after the record is submitted, and an in-order record
// starts at or below the rx_next its CPU read: every byte below rx_next is in
// a record reserved (so ordered in the ring) before rx_next covered it.
// Racing CPUs can only record the same bytes twice; never leave a hole.
//
// IPv4 only (a dual-stack IPv6 socket receiving IPv4 is fine: the packet is
// parsed, not the socket); other packets pass and are counted. IP fragments
// do not occur here: the IP layer reassembles before the socket layer.

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "ringconsumer.h"

#define ETH_P_IP 0x0800
#define IPPROTO_TCP 6
#define BPF_ANY 0
#define BPF_NOEXIST 1

// TCP header flags (byte 13 of the header).
#define TCP_SYN 0x02
#define TCP_RST 0x04
#define TCP_ACK 0x10

// bpf_sock.state values (BPF_TCP_*, the kernel's TCP states).
#define TCP_ESTABLISHED 1
#define TCP_SYN_SENT 2
#define TCP_SYN_RECV 3
#define TCP_FIN_WAIT1 4
#define TCP_FIN_WAIT2 5
#define TCP_LISTEN 10

// cgroup_skb verdicts.
#define VERDICT_PASS 1
#define VERDICT_DROP 0

// Bounded compare-and-swap retries: each failure means another CPU raised
// rx_next meanwhile; giving up leaves it lower, which costs at most a
// duplicate record or a drop.
#define CAS_TRIES 4

char __license[] SEC("license") = "Dual BSD/GPL";

// The record header: the same packed 36 bytes as tcplog.c's, followed by len
// payload bytes. netlog.DecodeRecord decodes exactly this.
struct record_hdr {
	__be32 saddr;     // remote sender, network byte order, as in the IP header
	__be32 daddr;     // local receiver, network byte order
	__be16 sport;     // network byte order, as in the TCP header
	__be16 dport;     // network byte order
	__u32 seq;        // host order: sequence number of the first payload byte
	__u32 len;        // payload length
	__u64 cgroup_id;  // bpf_skb_cgroup_id: the cgroup of the receiving socket
	__u64 ktime_ns;   // bpf_ktime_get_ns at recording
} __attribute__((packed));

_Static_assert(sizeof(struct record_hdr) == 36, "record header must be 36 bytes");

// rx_key is a flow as on the wire: saddr/sport the remote sender.
struct rx_key {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
};

struct rx_flow {
	__u32 rx_next; // every byte before it is recorded
	__u32 pad;
	__u64 cookie;  // socket cookie of the receiving socket; 0: set by a listener's SYN
};

_Static_assert(sizeof(struct rx_flow) == 16, "rx_flow must have no padding");

// Per-CPU counters; the loader sums them over CPUs.
struct recv_counters {
	__u64 packets_recorded;   // records written
	__u64 bytes_recorded;     // payload bytes written
	__u64 drops_backpressure; // dropped: ring buffer had no room
	__u64 drops_oversize;     // dropped: record can never fit the ring (grow the ring!)
	__u64 drops_error;        // dropped: dynptr setup/copy or flow map update failed
	__u64 out_of_order;       // recorded with a hole before it (held by the consumer)
	__u64 duplicates_passed;  // passed unrecorded: every byte recorded before
	__u64 no_tcp_sock;        // payload passed unrecorded: no TCP socket with a usable rcv_nxt
	__u64 non_ipv4;           // packets that are not IPv4, passed
	__u64 non_tcp;            // IPv4 packets that are not TCP, passed
	__u64 resyncs;            // rx_next raised to rcv_nxt: TCP had accepted unrecorded bytes
	__u64 syn_ignored;        // SYNs with payload to synchronized sockets, passed unrecorded
	__u64 unrecorded_passed;  // ring full and its consumer gone: passed unrecorded (a hole in the record)
};

// Set by the loader before load: the ring buffer size in bytes.
volatile const __u32 ring_size = 0;
// Set by the loader before load: while the consumer is polling, wake it only
// when the ring's fill crosses this many bytes.
volatile const __u32 wake_bytes = 0;
// Written by the consumer (mmapped .bss): nonzero while it polls the ring by
// itself. Same scheme as tcplog.c: records are then submitted without a
// wakeup unless the ring passes wake_bytes.
volatile __u32 consumer_polling = 0;

// A consumer that takes nothing from the full ring for CONSUMER_GONE_NS is
// gone (its agent stopped or hung): the jobs' segments then pass unrecorded
// instead of being dropped, as in tcplog.c. Dropped, the jobs received nothing
// for as long as their agent was stopped, and their senders' TCP gives up
// after its retries. The hole is seen by the consumer (a record past bytes it
// never got) and makes a check of re-sent bytes over it fail, loudly; the
// agent asks every member for a snapshot, which moves the checks past it.
// The consumer's position when a look at the full ring last found it moved,
// and when (ring_consumer_stuck).
volatile __u64 cons_seen = 0;
volatile __u64 cons_seen_ns = 0;

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 24); // the loader overrides this
} events SEC(".maps");

// LRU: only flows to attached cgroups get an entry. An evicted entry is
// re-created from the socket's rcv_nxt: no hole, at worst drops until TCP
// has processed its backlog.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct rx_key);
	__type(value, struct rx_flow);
} rx_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct recv_counters);
} stats SEC(".maps");

// Handshakes completed by the sockets of each cgroup (by bpf_skb_cgroup_id): a
// SYN-ACK reaching a socket in SYN_SENT, or the ACK that completes a passive
// open reaching its listener. The agent looks for connections a job's
// snapshot lacks when this moves. The loader deletes a cgroup's entry when it
// detaches from it.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u64);
	__type(value, __u64);
} handshakes SEC(".maps");

// The socket views of the sk_buff (UAPI, linux/bpf.h). The trimmed vmlinux.h
// only declares them: completing them there would change the BTF of the
// other programs' committed objects. Field offsets are relocated by name
// against the kernel's BTF, so only the fields used are listed.
struct bpf_sock {
	__u32 state;
} __attribute__((preserve_access_index));

struct bpf_tcp_sock {
	__u32 rcv_nxt;
} __attribute__((preserve_access_index));

// kfuncs: bpftool 7.1's vmlinux.h has no prototypes for them.
extern int bpf_dynptr_from_skb(struct __sk_buff *skb, __u64 flags,
			       struct bpf_dynptr *ptr__uninit) __ksym;
extern int bpf_dynptr_copy(struct bpf_dynptr *dst_ptr, __u32 dst_off,
			   struct bpf_dynptr *src_ptr, __u32 src_off, __u32 size) __ksym;

// after reports whether sequence number a comes after b (RFC 1982 serial
// arithmetic, across the 2^32 wrap).
static __always_inline int after(__u32 a, __u32 b)
{
	return (__s32)(a - b) > 0;
}

// raise_to raises *p from seen (the value last read) to v unless another CPU
// already put it at or after v. It returns whether this call stored v: two
// CPUs raising it to the same value store it once.
static __always_inline int raise_to(__u32 *p, __u32 seen, __u32 v)
{
	for (int i = 0; i < CAS_TRIES; i++) {
		__u32 old = __sync_val_compare_and_swap(p, seen, v);
		if (old == seen)
			return 1;
		if (!after(v, old))
			return 0;
		seen = old;
	}
	return 0;
}

// wake_flags returns the submit flags for a record of need ring bytes.
static __always_inline __u64 wake_flags(__u64 need)
{
	return ring_wake_flags(&events, consumer_polling, wake_bytes, need);
}

// record_start writes the record without payload that starts a flow at seq
// (see "Where rx_next comes from"). It fails if the ring has no room.
static __always_inline int record_start(struct __sk_buff *skb, struct iphdr *ip, struct tcphdr *tcp, __u32 seq)
{
	struct record_hdr hdr = {
		.saddr = ip->saddr,
		.daddr = ip->daddr,
		.sport = tcp->source,
		.dport = tcp->dest,
		.seq = seq,
		.len = 0,
		.cgroup_id = bpf_skb_cgroup_id(skb),
		.ktime_ns = bpf_ktime_get_ns(),
	};
	return bpf_ringbuf_output(&events, &hdr, sizeof(hdr), wake_flags(sizeof(hdr) + 8));
}

// count_handshake adds one to the handshakes of the skb's cgroup. A count
// lost to two CPUs creating the entry at once still leaves it changed.
static __always_inline void count_handshake(struct __sk_buff *skb)
{
	__u64 id = bpf_skb_cgroup_id(skb);
	__u64 *n = bpf_map_lookup_elem(&handshakes, &id);
	if (n) {
		__sync_fetch_and_add(n, 1);
		return;
	}
	__u64 one = 1;
	bpf_map_update_elem(&handshakes, &id, &one, BPF_NOEXIST);
}

// synchronized reports whether a socket in state holds a meaningful rcv_nxt
// and can still accept payload: not listening, not waiting for its SYN-ACK,
// and no FIN received yet (after one, every byte before it is in and any
// data segment is a retransmission or beyond the FIN).
static __always_inline int synchronized(__u32 state)
{
	return state == TCP_ESTABLISHED || state == TCP_SYN_RECV ||
	       state == TCP_FIN_WAIT1 || state == TCP_FIN_WAIT2;
}

SEC("cgroup_skb/ingress")
int tcprecv_ingress(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct recv_counters *c = bpf_map_lookup_elem(&stats, &zero);
	if (!c)
		return VERDICT_PASS; // cannot happen: a 1-entry array always has key 0

	if (skb->protocol != bpf_htons(ETH_P_IP)) {
		c->non_ipv4++;
		return VERDICT_PASS;
	}
	struct iphdr ip;
	if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)) || ip.version != 4 || ip.ihl < 5) {
		c->non_ipv4++;
		return VERDICT_PASS;
	}
	if (ip.protocol != IPPROTO_TCP) {
		c->non_tcp++;
		return VERDICT_PASS;
	}
	__u32 iphl = ip.ihl * 4;
	struct tcphdr tcp;
	if (bpf_skb_load_bytes(skb, iphl, &tcp, sizeof(tcp)))
		return VERDICT_PASS; // TCP checked the header already: cannot happen
	__u32 tcphl = tcp.doff * 4;
	// The IP length bounds the payload; BIG TCP GRO packets (> 64 KiB)
	// carry tot_len 0 and are sized from skb->len.
	__u32 iplen = bpf_ntohs(ip.tot_len);
	if (iplen == 0)
		iplen = skb->len;
	if (tcphl < sizeof(tcp) || iplen < iphl + tcphl || iplen > skb->len)
		return VERDICT_PASS; // malformed: TCP drops it
	__u32 len = iplen - iphl - tcphl;
	__u8 flags = ((__u8 *)&tcp)[13];
	__u32 seq = bpf_ntohl(tcp.seq);
	if ((flags & (TCP_SYN | TCP_RST | TCP_ACK)) == TCP_ACK) {
		// The ACK that completes a passive open reaches the listener (the
		// child socket is made after this filter); state is in sock_common,
		// readable without a full socket.
		struct bpf_sock *lsk = skb->sk;
		if (lsk && lsk->state == TCP_LISTEN)
			count_handshake(skb);
	}
	if (len == 0 && !(flags & TCP_SYN))
		return VERDICT_PASS; // pure ACK, bare FIN or RST: nothing to record

	struct bpf_sock *sk = skb->sk;
	if (sk)
		sk = bpf_sk_fullsock(sk);
	struct bpf_tcp_sock *tp = sk ? bpf_tcp_sock(sk) : 0;
	if (!sk || !tp) {
		if (len)
			c->no_tcp_sock++;
		return VERDICT_PASS;
	}
	__u32 state = sk->state;
	__u64 cookie = bpf_get_socket_cookie(skb);
	struct rx_key key = {
		.saddr = ip.saddr,
		.daddr = ip.daddr,
		.sport = tcp.source,
		.dport = tcp.dest,
	};

	if (flags & TCP_SYN) {
		if (state == TCP_SYN_SENT && (flags & TCP_ACK))
			count_handshake(skb);
		if (state != TCP_LISTEN && state != TCP_SYN_SENT) {
			if (len)
				c->syn_ignored++;
			return VERDICT_PASS;
		}
		// The SYN occupies seq; its payload (TCP Fast Open) starts after.
		seq++;
		struct rx_flow fresh = {
			.rx_next = seq,
			.cookie = state == TCP_LISTEN ? 0 : cookie,
		};
		if (bpf_map_update_elem(&rx_flows, &key, &fresh, BPF_ANY)) {
			c->drops_error++;
			return VERDICT_DROP; // the sender retransmits the SYN
		}
		if (record_start(skb, &ip, &tcp, seq)) {
			if (ring_consumer_stuck(&events, &cons_seen, &cons_seen_ns, bpf_ktime_get_ns())) {
				// Its consumer is gone: the connection is made unrecorded,
				// as its data would pass, instead of every SYN being dropped
				// until the peer's connect() times out. No entry: its data
				// starts one from rcv_nxt, as for a connection that
				// predates the attach.
				bpf_map_delete_elem(&rx_flows, &key);
				c->unrecorded_passed++;
				return VERDICT_PASS;
			}
			c->drops_backpressure++;
			return VERDICT_DROP; // likewise: the start must be in the ring
		}
		if (len == 0)
			return VERDICT_PASS;
	}
	// TCP accepts no payload from a RST, nor from a segment without ACK on
	// a synchronized connection: recording it could let bytes TCP never
	// took stand for the ones it takes later.
	if ((flags & TCP_RST) || !(flags & (TCP_ACK | TCP_SYN)))
		return VERDICT_PASS;

	struct rx_flow *f = bpf_map_lookup_elem(&rx_flows, &key);
	int stale = 0;
	if (f && f->cookie != cookie) {
		if (f->cookie == 0 && state != TCP_LISTEN) {
			f->cookie = cookie; // the child accepted from the listener that saw the SYN
		} else if (f->cookie != 0) {
			f = 0; // an earlier connection's socket on the same 4-tuple
			stale = 1;
		}
		// else: a listener that saw the SYN gets the data of the handshake's ACK
	}
	if (!f) {
		if (!synchronized(state)) {
			c->no_tcp_sock++;
			return VERDICT_PASS; // TCP accepts nothing here, or we cannot know where it stands
		}
		struct rx_flow fresh = { .rx_next = tp->rcv_nxt, .cookie = cookie };
		// Another CPU may create it first (BPF_NOEXIST fails): use theirs.
		bpf_map_update_elem(&rx_flows, &key, &fresh, stale ? BPF_ANY : BPF_NOEXIST);
		f = bpf_map_lookup_elem(&rx_flows, &key);
		if (!f || f->cookie != cookie) {
			c->drops_error++;
			return VERDICT_DROP;
		}
	}

	__u32 cur = f->rx_next;
	if (synchronized(state)) {
		__u32 rcv_nxt = tp->rcv_nxt;
		if (after(rcv_nxt, cur)) {
			// Counted once per raise, not by every CPU that saw the same rcv_nxt.
			if (raise_to(&f->rx_next, cur, rcv_nxt))
				c->resyncs++;
			cur = f->rx_next; // at or after rcv_nxt now, whoever raised it
		}
	}

	__u32 end = seq + len;
	if (!after(end, cur)) {
		c->duplicates_passed++;
		return VERDICT_PASS;
	}
	if (after(seq, cur))
		c->out_of_order++; // past a hole: recorded whole, rx_next stays
	__u32 n = len; // whole, from the first payload byte: see "seq < rx_next < end" above

	// The ring holds a record plus its 8-byte kernel header, rounded up to 8;
	// a bigger one can never be reserved: count the stall apart.
	__u64 need = ((__u64)sizeof(struct record_hdr) + n + 8 + 7) & ~7ULL;
	if (need > ring_size) {
		c->drops_oversize++;
		return VERDICT_DROP;
	}
	struct record_hdr hdr = {
		.saddr = ip.saddr,
		.daddr = ip.daddr,
		.sport = tcp.source,
		.dport = tcp.dest,
		.seq = seq,
		.len = n,
		.cgroup_id = bpf_skb_cgroup_id(skb),
		.ktime_ns = bpf_ktime_get_ns(),
	};
	struct bpf_dynptr rec, pkt;
	if (bpf_ringbuf_reserve_dynptr(&events, sizeof(hdr) + n, 0, &rec)) {
		// The verifier wants the failed dynptr released too.
		bpf_ringbuf_discard_dynptr(&rec, 0);
		if (ring_consumer_stuck(&events, &cons_seen, &cons_seen_ns, hdr.ktime_ns)) {
			c->unrecorded_passed++; // rx_next stays: the next segment resyncs past the hole
			return VERDICT_PASS;
		}
		c->drops_backpressure++;
		return VERDICT_DROP;
	}
	// One copy from the skb (linear part and page frags alike) straight into
	// the reserved record.
	if (bpf_dynptr_write(&rec, 0, &hdr, sizeof(hdr), 0) ||
	    bpf_dynptr_from_skb(skb, 0, &pkt) ||
	    bpf_dynptr_copy(&rec, sizeof(hdr), &pkt, iphl + tcphl, n)) {
		bpf_ringbuf_discard_dynptr(&rec, 0);
		c->drops_error++;
		return VERDICT_DROP;
	}
	bpf_ringbuf_submit_dynptr(&rec, wake_flags(need));
	if (!after(seq, cur))
		raise_to(&f->rx_next, cur, end);
	c->packets_recorded++;
	c->bytes_recorded += n;
	return VERDICT_PASS;
}
