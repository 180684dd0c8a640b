//go:build ignore

// ackclamp.c: lets a restored TCP socket re-send, at their original sequence
// numbers, bytes its peer already received.
//
// After a restore from a snapshot older than the failure, the restored
// program re-emits what it had sent since the snapshot; the peer's TCP
// already has those bytes (its rcv_nxt is ahead) and acknowledges each
// duplicate with its own rcv_nxt. Linux drops every segment whose ACK number
// is beyond its snd_nxt ("ACK of unsent data", tcp_ack), so the restored
// socket sees no ACK at all until it has re-sent everything: it must fit the
// whole gap in its initial congestion window, or it stalls in RTO backoff
// forever. Measured here: 12 MB of re-sent bytes stalled with a 22773-segment
// initial window.
//
// For each flow the agent registers (the restored socket's 4-tuple), two TCX
// programs on the host's interface fix that without touching the payload:
// egress records the restored socket's snd_nxt (highest seq + payload + SYN +
// FIN sent, wrap-safe); ingress lowers the ACK number of the peer's segments
// to that snd_nxt when it is beyond it (and fixes the TCP checksum), so the
// restored socket's ACK clock, congestion window and send buffer work as
// usual. A clamped ACK is true: the peer has every byte below its real ACK,
// so it has every byte the restored socket sent. Once the restored socket has
// caught up with the peer's rcv_nxt no ACK is beyond snd_nxt and the program
// changes nothing; the agent then removes the flow.
//
// Egress also sees the restored socket's pure ACKs that lie wholly below what
// the peer has acknowledged (the peer's ACK number before clamping, which its
// rcv_wup is never below): the peer would discard such a segment unread as an
// old sequence, its ACK number and window unseen, and answer it with a
// duplicate ACK, which lies beyond the restored socket's window while a replay
// still delivers the peer's bytes, so the restored socket answers it with its
// own duplicate ACK, and so on. Linux throttles that exchange with
// net.ipv4.tcp_invalid_ratelimit (500 ms); a host with it at 0 ran it as fast
// as both CPUs could, millions of segments a second, and the restored job
// starved (LAMMPS's replay failed 4 of 4 times). So such an ACK that
// acknowledges more than any before it is lifted: its sequence number becomes
// the peer's ACK number (a pure ACK carries no byte, and the restored socket
// sends its next byte there once it has re-sent the rest), and the peer takes
// it, learning what the replay delivered of its bytes; one that does not
// (a duplicate, the answer of a loop) is held back. Until 2026-12-05 every one
// was held back, and a peer heard nothing of what the replay delivered of its
// bytes until the restored socket had re-sent all of its own. (CI's stalls
// after a recovery, ci274, ci277 and ci278, had a peer in a long backoff; that
// this was their cause is not shown: docs/receive-order.md.)
//
// Ingress also keeps the highest TSval of the peer's own segments (peer_timestamp), for the segments the
// agent injects as the peer's.
//
// IPv4, Ethernet framing (one optional 802.1Q tag), like tcplog.c.

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char __license[] SEC("license") = "Dual BSD/GPL";

#define ETH_P_IP 0x0800
#define ETH_P_8021Q 0x8100
#define ETH_HLEN 14
#define VLAN_HLEN 4
#define IPPROTO_TCP 6
#define IP_MF 0x2000
#define IP_OFFSET 0x1FFF
// TCX_NEXT hands the packet to the next program of the TCX chain (the sender-side log on egress);
// TCX_PASS would end the chain and skip it.
#define TCX_NEXT -1

// clamp_key is the restored socket's flow as it sends: saddr/sport are the
// restored (local) end, in network byte order as in the headers.
struct clamp_key {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
};

struct clamp_state {
	__u32 snd_nxt;    // restored socket's highest sequence sent (wrap-safe max)
	__u32 hold;       // non-zero: drop the peer's segments that carry payload (see ackclamp_ingress)
	__u64 clamped;    // peer segments whose ACK was lowered
	__u32 peer_ack;   // the highest ACK number the peer sent, before clamping (valid if peer_acked)
	__u32 peer_acked; // non-zero once the peer's first ACK passed
	__u64 quieted;    // the restored socket's pure ACKs held back (below peer_ack, acknowledging nothing new)
	__u64 lifted;     // the restored socket's pure ACKs lifted to peer_ack (acknowledging more than before)
	__u32 lift_ack;   // the highest ACK number lifted (valid if lifted)
	__u32 peer_tsval; // the highest TSval of the peer's own segments (0: none seen), see peer_timestamp
};

// INJECTED_MARK is the skb mark of the segments the agent injects as the peer's (restore.InjectedMark, set
// with SO_MARK on its raw socket): never held. A mark, not a header field: the peer's own segments can carry
// any TOS (its IP_TOS, a DSCP re-mark), but reach TCX ingress from the wire with mark 0.
#define INJECTED_MARK 0x66746b69
#define TCX_DROP 2

_Static_assert(sizeof(struct clamp_state) == 48, "clamp_state must have no padding");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct clamp_key);
	__type(value, struct clamp_state);
} clamps SEC(".maps");

static __always_inline int after(__u32 a, __u32 b) { return (__s32)(a - b) > 0; }

// headers finds the IPv4 TCP headers of an Ethernet frame; 0 on success.
static __always_inline int headers(struct __sk_buff *skb, __u32 *nh, struct iphdr *ip, struct tcphdr *tcp)
{
	// An in-frame 802.1Q tag makes skb->protocol ETH_P_8021Q: the frame's type decides below.
	if (skb->protocol != bpf_htons(ETH_P_IP) && skb->protocol != bpf_htons(ETH_P_8021Q))
		return -1;
	__be16 proto;
	*nh = ETH_HLEN;
	if (bpf_skb_load_bytes(skb, 12, &proto, sizeof(proto)))
		return -1;
	if (proto == bpf_htons(ETH_P_8021Q)) {
		if (bpf_skb_load_bytes(skb, 16, &proto, sizeof(proto)))
			return -1;
		*nh += VLAN_HLEN;
	}
	if (proto != bpf_htons(ETH_P_IP))
		return -1;
	if (bpf_skb_load_bytes(skb, *nh, ip, sizeof(*ip)))
		return -1;
	if (ip->version != 4 || ip->ihl < 5 || ip->protocol != IPPROTO_TCP || (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET)))
		return -1;
	if (bpf_skb_load_bytes(skb, *nh + ip->ihl * 4, tcp, sizeof(*tcp)))
		return -1;
	if (tcp->doff < 5)
		return -1;
	return 0;
}

// set_tcp32 replaces a 32-bit field of the TCP header at tcpoff (at offset
// field, old its current value), keeping the checksum valid; 0 on success.
// The field and the checksum change by opposite amounts, so the sum of the
// packet's bytes, a CHECKSUM_COMPLETE skb's skb->csum, is unchanged: no
// BPF_F_RECOMPUTE_CSUM, which would add the field's change alone to it (and
// tcp_v4_rcv would then report "hw csum failure" and sum the segment again).
static __always_inline int set_tcp32(struct __sk_buff *skb, __u32 tcpoff, __u32 field, __be32 old, __be32 new)
{
	if (bpf_l4_csum_replace(skb, tcpoff + offsetof(struct tcphdr, check), old, new, sizeof(new)))
		return -1;
	return bpf_skb_store_bytes(skb, tcpoff + field, &new, sizeof(new), 0);
}

SEC("tcx/egress")
int ackclamp_egress(struct __sk_buff *skb)
{
	__u32 nh;
	struct iphdr ip;
	struct tcphdr tcp;
	if (headers(skb, &nh, &ip, &tcp))
		return TCX_NEXT;
	struct clamp_key k = {.saddr = ip.saddr, .daddr = ip.daddr, .sport = tcp.source, .dport = tcp.dest};
	struct clamp_state *st = bpf_map_lookup_elem(&clamps, &k);
	if (!st)
		return TCX_NEXT;
	__u32 iplen = bpf_ntohs(ip.tot_len);
	if (iplen == 0)
		iplen = skb->len - nh; // BIG TCP GSO
	__u32 hl = ip.ihl * 4 + tcp.doff * 4;
	if (iplen < hl)
		return TCX_NEXT;
	__u32 seq = bpf_ntohl(tcp.seq);
	__u32 end = seq + (iplen - hl) + tcp.syn + tcp.fin;
	if (after(end, st->snd_nxt))
		st->snd_nxt = end; // one socket's segments leave under its lock: no lost update
	// A pure ACK below what the peer acknowledged: the peer would discard it and answer (see the top).
	if (iplen == hl && tcp.ack && !tcp.syn && !tcp.fin && !tcp.rst && st->peer_acked && after(st->peer_ack, seq)) {
		__u32 ack = bpf_ntohl(tcp.ack_seq);
		if (st->lifted && !after(ack, st->lift_ack)) {
			__sync_fetch_and_add(&st->quieted, 1);
			return TCX_DROP;
		}
		if (set_tcp32(skb, nh + ip.ihl * 4, offsetof(struct tcphdr, seq), tcp.seq, bpf_htonl(st->peer_ack))) {
			__sync_fetch_and_add(&st->quieted, 1);
			return TCX_DROP;
		}
		st->lift_ack = ack;
		__sync_fetch_and_add(&st->lifted, 1);
	}
	return TCX_NEXT;
}

// TS_OPTION is NOP, NOP, kind 8, length 10: the first option word of every established segment Linux
// sends with timestamps (tcp_options_write; an MD5 or AO option would come first).
#define TS_OPTION 0x0101080a

// peer_timestamp records the TSval of the peer's segment in st->peer_tsval if it is the highest yet.
// The agent gives it to the segments it injects as the peer's (restore.PeerHeader): the restored socket
// echoes their TSval, and the peer takes now minus that echo for a round trip. With the TSval the recovery
// read at its start, a replay that took seconds made the peer's smoothed RTT 7.2 s and its retransmission
// timeout 22.9 s (measured): its next lost segment waited that long.
static __always_inline void peer_timestamp(struct __sk_buff *skb, __u32 tcpoff, struct tcphdr *tcp, struct clamp_state *st)
{
	if (tcp->doff < 8) // 20 bytes of header and 12 of NOP, NOP, timestamp
		return;
	__be32 opt[2];
	if (bpf_skb_load_bytes(skb, tcpoff + sizeof(*tcp), opt, sizeof(opt)) || opt[0] != bpf_htonl(TS_OPTION))
		return;
	__u32 tsval = bpf_ntohl(opt[1]);
	// Segments of one flow may arrive on several CPUs at once: a lost update leaves an older TSval, which
	// is still the peer's.
	if (!st->peer_tsval || after(tsval, st->peer_tsval))
		st->peer_tsval = tsval;
}

SEC("tcx/ingress")
int ackclamp_ingress(struct __sk_buff *skb)
{
	__u32 nh;
	struct iphdr ip;
	struct tcphdr tcp;
	if (headers(skb, &nh, &ip, &tcp))
		return TCX_NEXT;
	struct clamp_key k = {.saddr = ip.daddr, .daddr = ip.saddr, .sport = tcp.dest, .dport = tcp.source};
	struct clamp_state *st = bpf_map_lookup_elem(&clamps, &k);
	if (!st || skb->mark == INJECTED_MARK)
		return TCX_NEXT;
	peer_timestamp(skb, nh + ip.ihl * 4, &tcp, st);
	if (tcp.ack) {
		// Segments of one flow may arrive on several CPUs at once: a lost update leaves peer_ack lower,
		// which only holds back fewer of the restored socket's ACKs.
		__u32 real = bpf_ntohl(tcp.ack_seq);
		if (!st->peer_acked || after(real, st->peer_ack)) {
			st->peer_ack = real;
			st->peer_acked = 1;
		}
	}
	// While a replay delivers the peer's logged bytes one receive call at a time (intercept.Gate), the
	// peer's own data segments must not reach the socket: they are retransmissions of bytes the log
	// holds, and TCP would merge them into the queue ahead of the recorded order. Dropping them loses
	// nothing (the gate delivers every byte up to the peer's snd_nxt); the peer's ACKs still pass.
	if (st->hold) {
		__u32 iplen = bpf_ntohs(ip.tot_len);
		if (iplen == 0)
			iplen = skb->len - nh;
		if (iplen > ip.ihl * 4 + tcp.doff * 4)
			return TCX_DROP;
	}
	if (!tcp.ack)
		return TCX_NEXT;
	__u32 ack = bpf_ntohl(tcp.ack_seq);
	__u32 snd_nxt = st->snd_nxt;
	if (!after(ack, snd_nxt))
		return TCX_NEXT;
	if (set_tcp32(skb, nh + ip.ihl * 4, offsetof(struct tcphdr, ack_seq), tcp.ack_seq, bpf_htonl(snd_nxt)))
		return TCX_NEXT;
	__sync_fetch_and_add(&st->clamped, 1);
	return TCX_NEXT;
}

// hold_args is ackclamp_hold's context (the agent runs it with BPF_PROG_TEST_RUN).
struct hold_args {
	struct clamp_key key;
	__u32 on; // what clamp_state.hold becomes
};

// ackclamp_hold sets a registered flow's hold (returns 0; 1: no such flow) with one store in place.
// User space can only write a map value whole: a read, change and write-back put back what the TCX
// programs had raised in between (snd_nxt, the peer's ACK, the counters).
SEC("syscall")
int ackclamp_hold(struct hold_args *args)
{
	struct clamp_key k = args->key;
	struct clamp_state *st = bpf_map_lookup_elem(&clamps, &k);
	if (!st)
		return 1;
	st->hold = args->on;
	return 0;
}
