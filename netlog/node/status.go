package node

import (
	"net/netip"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/capture"
	"github.com/ftkit/ftkit/netlog/controller"
)

// Status is the log part of a host's status.
type Status struct {
	Counters capture.Counters   `json:"counters"`
	CapBytes int64              `json:"cap_bytes"`
	Events   []controller.Event `json:"events"`
	Released Released           `json:"released"` // logs of finished connections freed
}

// Status reads the node's counters and recent decisions.
func (n *Node) Status() Status {
	cnt, _ := n.src.Counters()
	n.mu.Lock()
	defer n.mu.Unlock()
	return Status{Counters: cnt, CapBytes: n.ctl.Config().Cap, Events: append([]controller.Event(nil), n.ev...), Released: n.released}
}

// Conn describes what the log holds for one connection, in wire (32-bit) sequence numbers.
type Conn struct {
	Src        netip.AddrPort `json:"src"`
	Dst        netip.AddrPort `json:"dst"`
	DstNode    string         `json:"dst_node,omitempty"`
	First      uint32         `json:"first"`      // lowest retained byte
	Contiguous uint32         `json:"contiguous"` // every byte of [first, contiguous) is retained
	Retained   int64          `json:"retained"`
	Trimmed    bool           `json:"trimmed"` // a receiver's snapshot released the bytes before floor
	Hole       bool           `json:"hole"`    // bytes are missing between contiguous and the last byte: still parked (log.park), else a hole (must never happen)
	// Floor is the trim point when Trimmed: bytes before it were released. First is above it while the
	// bytes at the bottom are still parked (log.park), taken into the log when a reader needs them.
	Floor uint32 `json:"floor,omitempty"`
	// Live is the sender's current state of the connection from its last egress segment.
	Live *ebpfprobes.FlowState `json:"live,omitempty"`
	// Release is where the connection stands on the way to being freed (release.Verdict): "open"
	// while its sender may send; once it finished, what its log still waits for.
	Release string `json:"release,omitempty"`
}

// Conns lists the connections in the log.
func (n *Node) Conns() []Conn {
	l := n.Log()
	n.mu.Lock()
	verdicts := n.verdicts
	n.mu.Unlock()
	var out []Conn
	for _, c := range l.Conns() {
		b, err := l.Bounds(c)
		if err != nil {
			continue
		}
		out = append(out, Conn{Src: c.Local, Dst: c.Remote, DstNode: n.cfg.Members.Owner(c.Remote.Addr()),
			First: netlog.Wire(b.First), Contiguous: netlog.Wire(b.Contiguous), Retained: b.Retained, Trimmed: b.Floor != 0,
			Hole: b.Contiguous != b.Last, Floor: netlog.Wire(b.Floor)})
		if fs, ok, err := n.src.FlowState(c); err == nil && ok {
			out[len(out)-1].Live = &fs
		}
		if v, ok := verdicts[c]; ok {
			out[len(out)-1].Release = v.String()
		}
	}
	return out
}
