//go:build linux

package ebpfprobes

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// TCP header flags, as found in FlowState.Flags.
const (
	TCPFlagFIN = 0x01
	TCPFlagSYN = 0x02
	TCPFlagRST = 0x04
	TCPFlagPSH = 0x08
	TCPFlagACK = 0x10
	TCPFlagURG = 0x20
	TCPFlagECE = 0x40
	TCPFlagCWR = 0x80
)

// flow_state.seen bits (bpf/tcplog.c).
const (
	seenSYN = 0x01
	seenACK = 0x02
	seenTS  = 0x04
	seenFIN = 0x08
	seenRST = 0x10
	// For the program only: logged_next is valid; the logged prefix is 2^31 bytes or longer.
	seenLogged = 0x20
	seenLong   = 0x40
)

// FlowState is the live TCP state of one flow as its SENDER put it on the
// wire: the logger updates it for every segment of a protected flow that
// leaves through the program (data, pure ACKs, SYN, FIN, RST and
// retransmissions alike). Segments the logger dropped for backpressure were
// never transmitted and do not count.
//
// For the restorer the flow that matters is the surviving peer P's flow
// toward the failed node F, tcpflow.Tuple{Local: P, Remote: F}, read from the logger on P:
// it is P's side of the connection, which the restored socket of F must be
// made to agree with (docs/tcp-relocation.md, "Leave-running
// snapshots"). The field comments use P and F in that sense. Read the state
// once P has fallen quiet toward F (F is dead: P sends only retransmissions
// and ACKs), so that it is final.
type FlowState struct {
	// SndNxt is P's snd_nxt: the sequence number after the last thing P
	// transmitted to F (payload bytes, plus the SYN and the FIN, which take
	// one sequence number each). It is a wrap-safe (serial-arithmetic)
	// maximum, so retransmissions never lower it; a RST does not move it.
	// Every payload byte P sent below DataEnd() has a record in P's log.
	// For the restorer: F's restored receive side must end at DataEnd():
	// inject P's logged bytes from the image's inq_seq up to DataEnd() and
	// set inq_seq and rcv_wup to DataEnd() (the note's "Inject the peer's
	// logged bytes": up to P's snd_nxt, not its snd_una, so that F's first
	// ACK releases P at once instead of after P's backed-off RTO). SndNxt can
	// trail the kernel's snd_nxt only by segments the logger dropped for
	// backpressure and TCP has not retransmitted yet; they are not in the log
	// either, and P retransmits them to the restored F.
	SndNxt uint32
	// Ack is the ACK number of P's last segment that had ACK set: P's
	// rcv_nxt, so every byte of F's stream below Ack has reached P. For the
	// restorer: F's restored snd_nxt must come up to Ack, or F discards P's
	// segments as "ACK of unsent data" (the note's problem 1); the bytes of
	// F's stream from the image's outq_seq up to Ack are already at P: either
	// F re-emits exactly those bytes at their original sequence numbers (the
	// note's option 1: the gap must fit the initial cwnd, so_sndbuf and
	// snd_wnd) or outq_seq is shifted to Ack and the out-queue dropped
	// (option 2: that many bytes of the re-executed program's output must be
	// swallowed). Valid only if HasAck.
	Ack uint32
	// TSval is the timestamp option value of P's last segment that had one:
	// P's own TCP timestamp clock. It is NOT a bound for F's restored
	// timestamp: the two ends' clocks are unrelated (each connection end
	// adds its own random offset), and PAWS on P compares F's TSval with
	// TSecr below. F would echo TSval (it is what F's ts_recent was), but
	// CRIU does not restore ts_recent and an echo is not checked by PAWS, so
	// the restorer does not need it; two samples of it show P's clock moving.
	TSval uint32
	// TSecr is the timestamp echo of P's last segment that had one: P's
	// ts_recent, the latest TSval of F that P accepted. For the restorer: the
	// restored socket's TCP timestamp (TCP_TIMESTAMP, criu/image
	// Conn.Timestamp) must not be below it, or P's PAWS check discards F's
	// segments until F's clock catches up (the note's problem 4). The note's
	// recipe, TSecr plus the milliseconds since the update, is
	// MinRestoredTimestamp. TSecr is final only after P acknowledged
	// everything F sent (P's ACK may be delayed by up to 200 ms).
	TSecr uint32
	// Window is the raw window field of P's last segment, unscaled: P's
	// receive window for F's data is Window << P's window scale (P's
	// rcv_wscale, which is snd_wscale in F's image); SYN and SYN-ACK windows
	// are never scaled. It bounds how much F can re-emit at once (option 1).
	Window uint16
	// HasTS says the TCP timestamp option was seen on P's segments (Linux
	// enables it by default: net.ipv4.tcp_timestamps=1). Without it TSval
	// and TSecr are 0 and PAWS does not apply.
	HasTS bool
	// Flags are the TCP flags of P's last segment (TCPFlag*).
	Flags uint8
	// KtimeNs is P's CLOCK_MONOTONIC (bpf_ktime_get_ns) at the last update,
	// in nanoseconds: compare it only with P's own monotonic clock (Age).
	KtimeNs uint64
	// Segments counts P's segments recorded since the entry was created, or
	// since the SYN that restarted it.
	Segments uint64

	// HasAck says Ack is valid (P sent a segment with ACK set).
	HasAck bool
	// ISN is P's initial sequence number, from its SYN (or SYN-ACK). Valid
	// only if HasISN: protection may have begun after the handshake. A SYN
	// with another ISN on the same 4-tuple starts a new state.
	ISN    uint32
	HasISN bool
	// FinSent says P sent a FIN: P's application closed or shut down its
	// sending side and no byte follows DataEnd(). The state is kept after a
	// FIN or a RST: the restorer may still need it.
	FinSent bool
	// RstSent says P sent a RST: P aborted the connection; there is nothing
	// left to restore on that flow.
	RstSent bool
}

// DataEnd is the sequence number after P's last payload byte: SndNxt, less
// the one sequence number P's FIN takes if it sent one. Payload ends where
// restored receive queues must end.
func (s FlowState) DataEnd() uint32 {
	if s.FinSent {
		return s.SndNxt - 1
	}
	return s.SndNxt
}

// PayloadSent is the number of payload bytes P sent on the connection,
// modulo 2^32: DataEnd() - ISN - 1 (the SYN takes the ISN). ok is false when
// the SYN was not seen.
func (s FlowState) PayloadSent() (n uint32, ok bool) {
	if !s.HasISN {
		return 0, false
	}
	return s.DataEnd() - s.ISN - 1, true
}

// MinRestoredTimestamp is the lowest TCP timestamp (TCP_TIMESTAMP value) the
// restored socket of F may start with, elapsed after the state's update
// (Age, measured on P): TSecr, the last TSval of F that P accepted, plus
// elapsed in milliseconds rounded up (F's clock kept running; TSvals tick
// in milliseconds unless microsecond timestamps were negotiated), rounded up
// to an even value because on Linux 6.7+ the value's low bit selects
// microsecond timestamps (criu-tcp-relocation.md, "Timestamps"). Serial
// arithmetic: the result may wrap past 2^32, as TSvals do.
func (s FlowState) MinRestoredTimestamp(elapsed time.Duration) uint32 {
	ms := uint32(max(0, (elapsed+time.Millisecond-1)/time.Millisecond))
	v := s.TSecr + ms
	return v + v&1
}

// Age is how long ago the state was updated, by this host's monotonic
// clock: meaningful only on the host whose logger produced the state.
func (s FlowState) Age() (time.Duration, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0, fmt.Errorf("tcplog: read CLOCK_MONOTONIC: %w", err)
	}
	return time.Duration(ts.Nano() - int64(s.KtimeNs)), nil
}

func flowStateFrom(v tcplogFlowState) FlowState {
	return FlowState{
		SndNxt:   v.SndNxt,
		Ack:      v.Ack,
		TSval:    v.Tsval,
		TSecr:    v.Tsecr,
		Window:   v.Window,
		HasTS:    v.Seen&seenTS != 0,
		Flags:    v.Flags,
		KtimeNs:  v.KtimeNs,
		Segments: v.Segments,
		HasAck:   v.Seen&seenACK != 0,
		ISN:      v.Isn,
		HasISN:   v.Seen&seenSYN != 0,
		FinSent:  v.Seen&seenFIN != 0,
		RstSent:  v.Seen&seenRST != 0,
	}
}

// FlowState returns the live state of flow f (Local is the sending end: for
// the restorer, the peer toward the failed node). ok is false when the
// logger has seen no segment of f since it was loaded (f is not protected,
// sends nothing, or was evicted: the map keeps the MaxFlows most recently active
// protected flows).
//
// The program updates the state in place without a lock; FlowState reads it
// until two consecutive reads agree, so it never returns a mix of two
// segments' fields.
func (l *TCPLogger) FlowState(f tcpflow.Tuple) (state FlowState, ok bool, err error) {
	k, err := flowKey(f)
	if err != nil {
		return FlowState{}, false, err
	}
	var prev tcplogFlowState
	for i := 0; i < 16; i++ {
		var v tcplogFlowState
		if err := l.objs.FlowStates.Lookup(&k, &v); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				return FlowState{}, false, nil
			}
			return FlowState{}, false, fmt.Errorf("tcplog: read state of flow %v->%v: %w", f.Local, f.Remote, err)
		}
		if i > 0 && v == prev {
			return flowStateFrom(v), true, nil
		}
		prev = v
	}
	return FlowState{}, false, fmt.Errorf("tcplog: state of flow %v->%v changed on each of 16 reads: read it when the flow is quiet", f.Local, f.Remote)
}

// FlowStates returns the state of every flow the logger holds, for
// diagnostics. It is not a snapshot: flows updated during the walk may show
// either state, and each value is read once.
func (l *TCPLogger) FlowStates() (map[tcpflow.Tuple]FlowState, error) {
	out := make(map[tcpflow.Tuple]FlowState)
	var k tcplogFlowKey
	var v tcplogFlowState
	it := l.objs.FlowStates.Iterate()
	for it.Next(&k, &v) {
		out[flowFromKey(k)] = flowStateFrom(v)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("tcplog: list flow states: %w", err)
	}
	return out, nil
}

// flowFromKey inverts flowKey.
func flowFromKey(k tcplogFlowKey) tcpflow.Tuple {
	var s, d [4]byte
	binary.NativeEndian.PutUint32(s[:], k.Saddr)
	binary.NativeEndian.PutUint32(d[:], k.Daddr)
	return tcpflow.Tuple{
		Local:  netip.AddrPortFrom(netip.AddrFrom4(s), htons(k.Sport)),
		Remote: netip.AddrPortFrom(netip.AddrFrom4(d), htons(k.Dport)),
	}
}
