package netlog

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// Log is the sender-side byte log of one node: a Store per connection, all sharing one slab
// pool, one memory meter and one spill file. One goroutine (the ring-buffer consumer) calls
// Append; any number of others may read, trim, age and remove concurrently.
type Log struct {
	env    *env
	mu     sync.RWMutex
	closed bool
	stores map[tcpflow.Tuple]*Store
	// holds are wire sequence numbers below which Trim and RemoveIdle must not drop a connection's
	// bytes, by connection (Hold); a connection may have a store or not yet.
	holds map[tcpflow.Tuple][]uint32
}

// NewLog returns an empty log.
func NewLog(opt Options) (*Log, error) {
	e, err := newEnv(opt)
	if err != nil {
		return nil, err
	}
	return &Log{env: e, stores: make(map[tcpflow.Tuple]*Store), holds: make(map[tcpflow.Tuple][]uint32)}, nil
}

// key normalises a connection so an IPv4-mapped IPv6 address and its IPv4 form name one store.
func key(c tcpflow.Tuple) tcpflow.Tuple { return c.Unmap() }

func (l *Log) lookup(c tcpflow.Tuple) (*Store, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.closed {
		return nil, ErrClosed
	}
	st := l.stores[key(c)]
	if st == nil {
		return nil, fmt.Errorf("netlog %v: %w", c, ErrUnknownConn)
	}
	return st, nil
}

func (l *Log) lookupOrCreate(c tcpflow.Tuple) (*Store, error) {
	k := key(c)
	l.mu.RLock()
	st, closed := l.stores[k], l.closed
	l.mu.RUnlock()
	if closed {
		return nil, ErrClosed
	}
	if st != nil {
		return st, nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, ErrClosed
	}
	if st = l.stores[k]; st == nil {
		st = newLogStore(l.env)
		l.stores[k] = st
	}
	return st, nil
}

// Append logs one captured segment, creating the connection's store on its first bytes.
// Segments without payload are ignored. A conflict is returned as a *ConflictError (wrapped
// with the connection) and nothing of the segment is stored; the log stays usable.
func (l *Log) Append(rec Record) error {
	if len(rec.Payload) == 0 {
		return nil
	}
	for {
		st, err := l.lookupOrCreate(rec.Conn)
		if err != nil {
			return err
		}
		err = st.AppendRecord(rec)
		if errors.Is(err, ErrClosed) {
			continue // Remove raced with us: the next lookup makes a fresh store (or sees the Log closed)
		}
		if err != nil {
			return fmt.Errorf("netlog %v: %w", rec.Conn, err)
		}
		return nil
	}
}

// NoteParked notes a parked segment of rec.Conn (Store.NoteParked), creating its store if needed.
func (l *Log) NoteParked(rec Record) error {
	for {
		st, err := l.lookupOrCreate(rec.Conn)
		if err != nil {
			return err
		}
		// As in Append: a store removed since the lookup is not a closed log (which the consumer
		// stops for); the next lookup makes a fresh store, or sees the Log closed.
		if err = st.NoteParked(rec); !errors.Is(err, ErrClosed) {
			return err
		}
	}
}

// SetBase anchors conn's store at seq (see Store.SetBase), creating the store if needed.
func (l *Log) SetBase(conn tcpflow.Tuple, seq uint32) (uint64, error) {
	st, err := l.lookupOrCreate(conn)
	if err != nil {
		return 0, err
	}
	abs, err := st.SetBase(seq)
	if err != nil {
		return 0, fmt.Errorf("netlog %v: %w", conn, err)
	}
	return abs, nil
}

// Unwrap returns the absolute sequence conn's store gives the wire sequence seq.
func (l *Log) Unwrap(conn tcpflow.Tuple, seq uint32) (uint64, error) {
	st, err := l.lookup(conn)
	if err != nil {
		return 0, err
	}
	return st.Unwrap(seq), nil
}

// UnwrapServable is Unwrap for the start of a range a restorer asks for, with the store's bounds, refused
// unless the restorer can only mean that position and what the log holds from there is what was sent
// (Bounds.Servable).
func (l *Log) UnwrapServable(conn tcpflow.Tuple, seq uint32) (uint64, Bounds, error) {
	st, err := l.lookup(conn)
	if err != nil {
		return 0, Bounds{}, err
	}
	abs, b := st.Unwrap(seq), st.Bounds()
	return abs, b, b.Servable(abs)
}

// Range returns a copy of the bytes conn sent in [from, to) (absolute sequence numbers).
func (l *Log) Range(conn tcpflow.Tuple, from, to uint64) ([]byte, error) {
	st, err := l.lookup(conn)
	if err != nil {
		return nil, err
	}
	b, err := st.Bytes(from, to)
	if err != nil {
		return nil, fmt.Errorf("netlog %v: %w", conn, err)
	}
	return b, nil
}

// WriteRange streams the bytes conn sent in [from, to) to w (see Store.WriteRange).
func (l *Log) WriteRange(ctx context.Context, w io.Writer, conn tcpflow.Tuple, from, to uint64) (int64, error) {
	st, err := l.lookup(conn)
	if err != nil {
		return 0, err
	}
	n, err := st.WriteRange(ctx, w, from, to)
	if err != nil {
		return n, fmt.Errorf("netlog %v: %w", conn, err)
	}
	return n, nil
}

// Trim drops the bytes conn sent before wire sequence seq (the receiver's snapshot inq_seq)
// and returns the absolute trim point.
func (l *Log) Trim(conn tcpflow.Tuple, seq uint32) (uint64, error) { return l.trim(conn, nil, seq) }

// TrimStore is Trim of st only: while st is no longer conn's store (the connection was freed, and a new one
// on the same 4-tuple may have started a store of its own) it trims nothing and returns ErrUnknownConn. A
// point checked against one connection, and applied later, must not be placed in the next one's sequence
// space, where it could land ahead of everything that connection sent and drop it.
func (l *Log) TrimStore(conn tcpflow.Tuple, st *Store, seq uint32) (uint64, error) {
	return l.trim(conn, st, seq)
}

// trim is Trim of conn's store, if it is want (any store if want is nil).
func (l *Log) trim(conn tcpflow.Tuple, want *Store, seq uint32) (uint64, error) {
	k := key(conn)
	// The log's lock is held until the store is trimmed (lock order Log then Store, as in RemoveIdle): a
	// Hold granted between reading the holds and trimming was trimmed past, its bytes still there when
	// the holder took it, and the check it was taken for then found them gone.
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.closed {
		return 0, ErrClosed
	}
	st := l.stores[k]
	if st == nil || want != nil && st != want {
		return 0, fmt.Errorf("netlog %v: %w", conn, ErrUnknownConn)
	}
	if held, ok := l.heldFrom(k); ok && seqAfter(seq, held) {
		seq = held
	}
	return st.Trim(seq)
}

// Hold keeps the bytes conn sends from wire sequence seq on (Trim stops there, RemoveIdle keeps the
// connection) until release is called; the connection need not have sent anything yet. A recovery holds
// the bytes its restored job re-sends until it has checked them: the peer's next snapshot, taken
// meanwhile, would otherwise trim them away before the check reads them.
func (l *Log) Hold(conn tcpflow.Tuple, seq uint32) (release func()) {
	k := key(conn)
	l.mu.Lock()
	l.holds[k] = append(l.holds[k], seq)
	l.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			hs := l.holds[k]
			if i := slices.Index(hs, seq); i >= 0 {
				hs = slices.Delete(hs, i, i+1)
			}
			if len(hs) == 0 {
				delete(l.holds, k)
			} else {
				l.holds[k] = hs
			}
		})
	}
}

// heldFrom returns the earliest held sequence number of k (l.mu held).
func (l *Log) heldFrom(k tcpflow.Tuple) (uint32, bool) {
	hs := l.holds[k]
	if len(hs) == 0 {
		return 0, false
	}
	first := hs[0]
	for _, h := range hs[1:] {
		if seqAfter(first, h) {
			first = h
		}
	}
	return first, true
}

// seqAfter says whether wire sequence a comes after b (modulo 2^32, RFC 793 comparison).
func seqAfter(a, b uint32) bool { return int32(a-b) > 0 }

// Bounds returns conn's live bounds.
func (l *Log) Bounds(conn tcpflow.Tuple) (Bounds, error) {
	st, err := l.lookup(conn)
	if err != nil {
		return Bounds{}, err
	}
	return st.Bounds(), nil
}

// Holds reports whether the log holds every byte conn sent in [from, end), wire sequences: a byte there
// still parked is a hole (it is taken into the log on Wake). Bytes below from are not asked about: a hole
// there (a segment lost before the restore point) must not hold up a reader of the bytes from from on.
// Bytes below the trim point will never come: they are not waited for (the read names them). A store
// without a reference point holds nothing (and Unwrap, which would give it one, is not called).
func (l *Log) Holds(conn tcpflow.Tuple, from, end uint32) bool {
	st, err := l.lookup(conn)
	return err == nil && st.Holds(from, end)
}

// WaitHolds waits until the log holds conn's bytes in [from, end) (Holds), looking every period and
// calling poke before each wait (to wake whatever fills the log), until ctx ends. It reports whether they
// are there.
func (l *Log) WaitHolds(ctx context.Context, conn tcpflow.Tuple, from, end uint32, period time.Duration, poke func()) bool {
	for !l.Holds(conn, from, end) {
		poke()
		select {
		case <-ctx.Done():
			return false
		case <-time.After(period):
		}
	}
	return true
}

// Store returns conn's store, for callers that make many calls on one connection.
func (l *Log) Store(conn tcpflow.Tuple) (*Store, error) { return l.lookup(conn) }

// Conns lists the connections in the log, sorted.
func (l *Log) Conns() []tcpflow.Tuple {
	l.mu.RLock()
	out := make([]tcpflow.Tuple, 0, len(l.stores))
	for c := range l.stores {
		out = append(out, c)
	}
	l.mu.RUnlock()
	slices.SortFunc(out, func(a, b tcpflow.Tuple) int {
		if c := a.Local.Compare(b.Local); c != 0 {
			return c
		}
		return a.Remote.Compare(b.Remote)
	})
	return out
}

// Remove frees conn's store and forgets the connection (it closed and its peer checkpointed
// past the last byte). A segment that arrives later starts a new store.
func (l *Log) Remove(conn tcpflow.Tuple) error {
	k := key(conn)
	l.mu.Lock()
	st := l.stores[k]
	delete(l.stores, k)
	l.mu.Unlock()
	if st == nil {
		return fmt.Errorf("netlog %v: %w", conn, ErrUnknownConn)
	}
	return st.Close()
}

// RemoveIdle removes conn's store like Remove, but only if no segment was offered to it after
// lastAppend (the Activity the caller based its decision on): a connection that sent again
// since (a new connection on the same 4-tuple, say) is kept. It returns whether it removed
// the store and, if so, the store's accounting just before its memory was freed.
func (l *Log) RemoveIdle(conn tcpflow.Tuple, lastAppend time.Time) (bool, Stats, error) {
	k := key(conn)
	l.mu.Lock()
	st := l.stores[k]
	if st == nil {
		closed := l.closed
		l.mu.Unlock()
		if closed {
			return false, Stats{}, ErrClosed
		}
		return false, Stats{}, fmt.Errorf("netlog %v: %w", conn, ErrUnknownConn)
	}
	// Lock order Log then Store, as everywhere; the appender takes only the store's lock, so
	// an append either lands before the check (and keeps the store) or finds it closed and
	// starts a new one through Append.
	_, held := l.heldFrom(k)
	st.mu.Lock()
	if held || st.closed || st.lastAppend.After(lastAppend) {
		st.mu.Unlock()
		l.mu.Unlock()
		return false, Stats{}, nil
	}
	st.closed = true
	delete(l.stores, k)
	l.mu.Unlock()
	stats := st.Stats()
	st.dropAll()
	st.mu.Unlock()
	return true, stats, nil
}

// Activity returns conn's Activity.
func (l *Log) Activity(conn tcpflow.Tuple) (Activity, error) {
	st, err := l.lookup(conn)
	if err != nil {
		return Activity{}, err
	}
	return st.Activity(), nil
}

// Stats returns the node-wide accounting: the sums over all stores plus the pool.
func (l *Log) Stats() Stats {
	st := l.env.meter.snapshot()
	l.mu.RLock()
	st.Conns = len(l.stores)
	l.mu.RUnlock()
	return st
}

// ConnStats returns the accounting of one connection.
func (l *Log) ConnStats(conn tcpflow.Tuple) (Stats, error) {
	st, err := l.lookup(conn)
	if err != nil {
		return Stats{}, err
	}
	return st.Stats(), nil
}

// Age compresses aged slabs of every store (Options.CompressAfter, CompressAboveRAM) and,
// if the log's memory still exceeds Options.SpillAboveRAM, spills the oldest sealed slabs of
// the largest stores first. It also releases the pooled slab buffers that sat unused for
// Options.PoolKeep. Run it periodically from a maintenance
// goroutine.
func (l *Log) Age(ctx context.Context, now time.Time) (AgeReport, error) {
	return l.age(ctx, now, true)
}

// Compress is Age without the spill: for the periodic pass of a log whose spills its controller decides
// (node.Node), which asks the receivers for snapshots first.
func (l *Log) Compress(ctx context.Context, now time.Time) (AgeReport, error) {
	return l.age(ctx, now, false)
}

func (l *Log) age(ctx context.Context, now time.Time, spill bool) (AgeReport, error) {
	l.mu.RLock()
	stores := make([]*Store, 0, len(l.stores))
	for _, st := range l.stores {
		stores = append(stores, st)
	}
	l.mu.RUnlock()

	l.env.pool.shrink(now)
	var r AgeReport
	var a ager
	for _, st := range stores {
		sr, err := st.compress(ctx, now, &a)
		r.add(sr)
		if err != nil {
			return r, err
		}
	}
	if !spill || l.env.spillExcess(&l.env.meter) <= 0 {
		return r, nil
	}
	l.env.pool.drain()
	type sized struct {
		st  *Store
		mem int64
	}
	bySize := make([]sized, len(stores))
	for i, st := range stores { // read once: the sort needs stable keys while appends go on
		bySize[i] = sized{st, st.own.ram.Load() + st.own.comp.Load()}
	}
	slices.SortFunc(bySize, func(a, b sized) int { return cmp.Compare(b.mem, a.mem) })
	for _, z := range bySize {
		st := z.st
		over := l.env.spillExcess(&l.env.meter)
		if over <= 0 {
			break
		}
		sr, err := st.spillSlabs(ctx, over)
		r.add(sr)
		if err != nil {
			return r, fmt.Errorf("netlog: %w", err)
		}
	}
	if r.Spilled > 0 {
		l.env.log.Info("netlog spilled slabs to disk", "slabs", r.Spilled, "bytes", r.SpilledBytes, "freed", r.SpillFreedBytes)
	}
	return r, nil
}

// Close frees every store and removes the spill file.
func (l *Log) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	stores := l.stores
	l.stores = nil
	l.mu.Unlock()
	for _, st := range stores {
		st.Close()
	}
	l.env.pool.drain()
	if err := l.env.closeSpill(); err != nil {
		return fmt.Errorf("close netlog: %w", err)
	}
	return nil
}
