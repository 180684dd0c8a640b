package intercept

import (
	"context"
	"errors"
	"fmt"

	"github.com/ftkit/ftkit/tcpflow"
)

// An Injector delivers bytes to a restored socket as if its peer had sent them (restore.InjectSegment).
type Injector interface {
	Inject(conn tcpflow.Tuple, seq uint32, data []byte) error
}

// A Source is what a peer sent on one connection from the snapshot's copied_seq on: the bytes of the
// snapshot's receive queue, then those of the peer's log.
type Source struct {
	Seq  uint32
	Data []byte
}

func (s Source) end() uint32 { return s.Seq + uint32(len(s.Data)) }

// ErrDiverged marks a restored job that consumed its connections in another order or other amounts than
// its determinants say: it is not re-executing what its peers saw.
var ErrDiverged = errors.New("the restored job's receive calls diverged from the recorded ones")

// A Gate replays a restored job's determinants (see the package documentation).
type Gate struct {
	dets    []Det
	sources map[tcpflow.Tuple]Source
}

// NewGate is the gate of a job restored with empty receive queues on the connections of sources, which
// replays dets (the determinants since its snapshot, Store.Since) on those; receive determinants of other
// connections (both ends restored, or made after the snapshot) are not gated, and every send marks where
// one group of receive calls ends. It fails if a determinant consumed bytes its source does not hold, or
// consumed less than the one before on its connection.
func NewGate(dets []Det, sources map[tcpflow.Tuple]Source) (*Gate, error) {
	g := &Gate{sources: make(map[tcpflow.Tuple]Source, len(sources))}
	at := map[tcpflow.Tuple]uint32{}
	for c, s := range sources {
		g.sources[c.Unmap()] = s
		at[c.Unmap()] = s.Seq
	}
	for i, d := range dets {
		c := d.Conn.Unmap()
		d.Conn = c
		if d.Send {
			if n := len(g.dets); n > 0 && !g.dets[n-1].Send {
				g.dets = append(g.dets, d)
			}
			continue
		}
		s, ok := g.sources[c]
		if !ok {
			continue
		}
		if !seqAfter(d.End, at[c]) || seqAfter(d.End, s.end()) {
			return nil, fmt.Errorf("determinant %d (%s): the peer's bytes run from %d to %d, and the connection's previous determinant ended at %d", i, d, s.Seq, s.end(), at[c])
		}
		at[c] = d.End
		g.dets = append(g.dets, d)
	}
	return g, nil
}

// Len is how many receive determinants the gate replays.
func (g *Gate) Len() int {
	n := 0
	for _, d := range g.dets {
		if !d.Send {
			n++
		}
	}
	return n
}

// Conns is how many connections its determinants consumed.
func (g *Gate) Conns() int {
	seen := map[tcpflow.Tuple]bool{}
	for _, d := range g.dets {
		if !d.Send {
			seen[d.Conn] = true
		}
	}
	return len(seen)
}

// Run replays, one group at a time: the receive calls the original made between two of its sends. For a
// group it injects the bytes each of its connections lacks up to the group's last determinant there, in
// the order of the determinants (the sockets become readable in the order the original read them), then
// waits until the restored job, as this host's recorder reports it on events, has consumed exactly those
// bytes: the original had read them all before its next visible action, so the restored job has them all
// before it can act. Within a group it may read them in other calls and another order (one read of what the
// original read in two); consuming a connection the group does not read, or past its end, fails with
// ErrDiverged. A closed events channel (the recorder lost some) or ctx's end fails too. After the last
// group it injects the rest of every source, and the job reads freely. Injected is the number of bytes
// injected when it returns.
func (g *Gate) Run(ctx context.Context, inj Injector, events <-chan Det) (injected int64, err error) {
	next := make(map[tcpflow.Tuple]uint32, len(g.sources)) // injected up to
	prev := make(map[tcpflow.Tuple]uint32, len(g.sources)) // consumed up to
	for c, s := range g.sources {
		next[c], prev[c] = s.Seq, s.Seq
	}
	inject := func(c tcpflow.Tuple, end uint32) error {
		s := g.sources[c]
		from := next[c]
		if !seqAfter(end, from) {
			return nil
		}
		if err := inj.Inject(c, from, s.Data[from-s.Seq:end-s.Seq]); err != nil {
			return fmt.Errorf("inject %d bytes of %s's peer at %d: %w", end-from, c, from, err)
		}
		injected += int64(end - from)
		next[c] = end
		return nil
	}
	done := 0 // receive determinants replayed
	for i := 0; i < len(g.dets); {
		if g.dets[i].Send {
			i++
			continue
		}
		j := i
		want := map[tcpflow.Tuple]uint32{} // per connection, where the group's consumption ends
		for ; j < len(g.dets) && !g.dets[j].Send; j++ {
			d := g.dets[j]
			if err := inject(d.Conn, d.End); err != nil {
				return injected, err
			}
			want[d.Conn] = d.End
		}
		for len(want) > 0 {
			select {
			case <-ctx.Done():
				return injected, fmt.Errorf("determinants %d to %d of %d: the restored job did not make those receive calls: %w", done+1, done+j-i, g.Len(), context.Cause(ctx))
			case e, ok := <-events:
				if !ok {
					return injected, fmt.Errorf("determinants %d to %d of %d: this host's recorder lost receive calls of the restored job", done+1, done+j-i, g.Len())
				}
				e.Conn = e.Conn.Unmap()
				if _, gated := g.sources[e.Conn]; !gated || e.Send {
					continue
				}
				w, ok := want[e.Conn]
				if !ok || !seqAfter(e.End, prev[e.Conn]) || seqAfter(e.End, w) {
					return injected, fmt.Errorf("determinants %d to %d of %d: the restored job %s, where the original read %s up to %d before its next send: %w",
						done+1, done+j-i, g.Len(), e, e.Conn, w, ErrDiverged)
				}
				prev[e.Conn] = e.End
				if e.End == w {
					delete(want, e.Conn)
				}
			}
		}
		done += j - i
		i = j
	}
	for c, s := range g.sources {
		if err := inject(c, s.end()); err != nil {
			return injected, err
		}
	}
	return injected, nil
}
