package intercept

import (
	"context"
	"errors"
	"fmt"
	"sync"

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

// inject delivers s's bytes of conn c from from up to end (nothing if end is not after from) and says how
// many.
func (s Source) inject(inj Injector, c tcpflow.Tuple, from, end uint32) (int64, error) {
	if !seqAfter(end, from) {
		return 0, nil
	}
	if err := inj.Inject(c, from, s.Data[from-s.Seq:end-s.Seq]); err != nil {
		return 0, fmt.Errorf("inject %d bytes of %s's peer at %d: %w", end-from, c, from, err)
	}
	return int64(end - from), nil
}

// ErrDiverged marks a restored job that consumed its connections in another order or other amounts than
// its determinants say: it is not re-executing what its peers saw.
var ErrDiverged = errors.New("the restored job's receive calls diverged from the recorded ones")

// A Gate replays a restored job's determinants (see the package documentation).
type Gate struct {
	dets    []Det // the receive calls that consumed bytes of a gated connection
	all     []Det // every receive call on a gated connection, those that found nothing included
	sources map[tcpflow.Tuple]Source
	plans   []*threadPlan            // positions mode (UsePositions); nil: the order of dets only
	preload map[tcpflow.Tuple]uint32 // positions mode: where each connection's bytes in the restored queue end
	armed   bool                     // positions mode: ArmFirst ran
}

// NewGate is the gate of a job restored with empty receive queues on the connections of sources, which
// replays dets (the determinants since its snapshot, Store.Since) on those; determinants of other
// connections (both ends restored, or made after the snapshot) are not gated. It fails if a determinant
// consumed bytes its source does not hold, consumed less than the one before on its connection, or did not
// start where that one ended (a call the record misses).
func NewGate(dets []Det, sources map[tcpflow.Tuple]Source) (*Gate, error) {
	g := &Gate{sources: make(map[tcpflow.Tuple]Source, len(sources))}
	at := map[tcpflow.Tuple]uint32{}
	for c, s := range sources {
		if len(s.Data) >= 1<<31 {
			// 32-bit sequence numbers place nothing 2 GiB or more past the snapshot's copied_seq: neither
			// this gate's checks nor Store.Since, which may then have taken a call after the dump for the last
			// one before it and cut the calls of other connections before that off what it gave.
			return nil, fmt.Errorf("the peer of %s sent %d bytes since the snapshot, 2 GiB or more: sequence numbers cannot place the receive calls on it", c, len(s.Data))
		}
		g.sources[c.Unmap()] = s
		at[c.Unmap()] = s.Seq
	}
	for i, d := range dets {
		c := d.Conn.Unmap()
		s, ok := g.sources[c]
		if !ok {
			continue
		}
		d.Conn = c
		g.all = append(g.all, d)
		if d.Len == 0 {
			continue // found nothing: only positions mode uses it
		}
		if !seqAfter(d.End, at[c]) || seqAfter(d.End, s.end()) {
			return nil, fmt.Errorf("determinant %d (%s): the peer's bytes run from %d to %d, and the connection's previous determinant ended at %d", i, d, s.Seq, s.end(), at[c])
		}
		if d.End-d.Len != at[c] {
			// Bytes between the previous determinant and this call were consumed by a call the record does
			// not hold (splice, TCP_ZEROCOPY_RECEIVE, two readers of the socket): replaying it would vouch
			// for an order the original did not have.
			return nil, fmt.Errorf("determinant %d (%s): it consumed from %d, and the connection's previous determinant ended at %d: the record misses a receive call", i, d, d.End-d.Len, at[c])
		}
		at[c] = d.End
		g.dets = append(g.dets, d)
	}
	return g, nil
}

// Len is how many determinants the gate replays.
func (g *Gate) Len() int { return len(g.dets) }

// Conns is how many connections its determinants consumed.
func (g *Gate) Conns() int {
	seen := map[tcpflow.Tuple]bool{}
	for _, d := range g.dets {
		seen[d.Conn] = true
	}
	return len(seen)
}

// Run replays. In positions mode (UsePositions; the job restored with Preload's bytes in its queues and
// ArmFirst called before it ran; stops must be set), see runPositions. Otherwise, for each determinant in order it injects the bytes its connection lacks up to the
// determinant's End, then waits for the restored job's receive call that consumes them, as this host's
// recorder reports it on events (Conn, End; calls on other connections are ignored). After the last, it
// injects the rest of every source, and the job reads freely. A call that consumed another connection or
// another amount fails with ErrDiverged; a closed events channel (the recorder lost some) or ctx's end
// fails too. Injected is the number of bytes injected when it returns.
func (g *Gate) Run(ctx context.Context, inj Injector, events <-chan Event, stops Stopper) (injected int64, err error) {
	next := make(map[tcpflow.Tuple]uint32, len(g.sources))
	for c, s := range g.sources {
		next[c] = s.Seq
		if end, ok := g.preload[c]; ok {
			next[c] = end // in the restored queue already
		}
	}
	inject := func(c tcpflow.Tuple, end uint32) error {
		n, err := g.sources[c].inject(inj, c, next[c], end)
		injected += n
		if n > 0 {
			next[c] = end
		}
		return err
	}
	if g.plans != nil {
		if stops == nil {
			return 0, errors.New("a gate in positions mode needs the host's stops")
		}
		if err := g.runPositions(ctx, events, stops, inject); err != nil {
			return injected, err
		}
		return g.injectRest(inj, next, injected)
	}
	prev := make(map[tcpflow.Tuple]uint32, len(g.sources)) // how far the restored job consumed
	for c, s := range g.sources {
		prev[c] = s.Seq
	}
	// The threads that read in the original: a restore keeps their ids. Another of them making a call is
	// a socket read by two that handed the bytes to the wrong one; a thread the original did not have (made
	// after the restore, its id the kernel's choice) is matched on the connection and end alone.
	readers := map[uint32]bool{}
	for _, d := range g.dets {
		readers[d.Thread] = true
	}
	for i, d := range g.dets {
		if err := inject(d.Conn, d.End); err != nil {
			return injected, err
		}
		for matched := false; !matched; {
			select {
			case <-ctx.Done():
				return injected, fmt.Errorf("determinant %d of %d (%s): the restored job did not make that receive call: %w", i+1, len(g.dets), d, context.Cause(ctx))
			case ev, ok := <-events:
				if !ok {
					return injected, fmt.Errorf("determinant %d of %d (%s): this host's recorder lost receive calls of the restored job", i+1, len(g.dets), d)
				}
				e := ev.Det
				e.Conn = e.Conn.Unmap()
				if _, gated := g.sources[e.Conn]; !gated || ev.AtPoll || e.Len == 0 {
					continue
				}
				switch {
				case e.Thread != d.Thread && readers[e.Thread]:
					return injected, fmt.Errorf("determinant %d of %d: the original %s, the restored job %s (another thread): %w", i+1, len(g.dets), d, e, ErrDiverged)
				case e.Conn == d.Conn && e.End == d.End:
					matched = true
				case e.Conn == d.Conn && seqAfter(d.End, e.End) && seqAfter(e.End, prev[d.Conn]):
					// Part of the bytes: a read woke between two injected segments. The rest follows.
					prev[d.Conn] = e.End
				default:
					return injected, fmt.Errorf("determinant %d of %d: the original %s, the restored job %s: %w", i+1, len(g.dets), d, e, ErrDiverged)
				}
			}
		}
		prev[d.Conn] = d.End
	}
	return g.injectRest(inj, next, injected)
}

// injectRest injects the rest of every source, from next on, and returns injected plus what it injected.
func (g *Gate) injectRest(inj Injector, next map[tcpflow.Tuple]uint32, injected int64) (int64, error) {
	// The rest of every connection at once: delivering one connection's whole rest may wait for the job to
	// read it (its window), while the job first reads another.
	ns, errs := make([]int64, len(g.sources)), make([]error, len(g.sources))
	var wg sync.WaitGroup
	i := 0
	for c, s := range g.sources {
		k, from := i, next[c]
		wg.Go(func() { ns[k], errs[k] = s.inject(inj, c, from, s.end()) })
		i++
	}
	wg.Wait()
	for _, n := range ns {
		injected += n
	}
	return injected, errors.Join(errs...)
}
