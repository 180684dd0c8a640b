package recvdigest

import (
	"container/list"
	"hash/crc32"
	"slices"
	"sort"
	"sync"

	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/tcpflow"
)

// Defaults of BookOptions.
const (
	DefaultMaxPiecesPerFlow     = MaxPieces
	DefaultMaxFlows             = 1 << 14
	DefaultMaxReorderBytes      = 1 << 20
	DefaultMaxTotalPieces       = 1 << 20
	DefaultMaxTotalReorderBytes = 64 << 20
)

// maxWindow is the farthest a genuine segment can lie from the next expected byte: TCP windows are at most
// 2^30 bytes. A record farther away belongs to a new connection on a reused 4-tuple.
const maxWindow = 1 << 30

// BookOptions bound a Book's memory. Zero (or negative) fields take the defaults.
type BookOptions struct {
	// MaxPiecesPerFlow bounds the pieces kept per flow (default and at most MaxPieces: 1 GiB of stream);
	// the oldest go first.
	MaxPiecesPerFlow int
	// MaxFlows bounds the flows tracked (default 16384); the least recently updated flow of the job
	// (receiving cgroup) tracking the most is evicted.
	MaxFlows int
	// MaxReorderBytes bounds the out-of-order bytes held per flow while a gap may still fill (default
	// 1 MiB); past it the gap is accepted as a hole.
	MaxReorderBytes int
	// MaxTotalPieces bounds the pieces of all flows together (default 2^20, 12 MiB of pieces); past it the
	// least recently updated flows of the job holding the most pieces are evicted.
	MaxTotalPieces int
	// MaxTotalReorderBytes bounds the out-of-order bytes held by all flows together (default 64 MiB); past
	// it the flow being updated accepts its gaps as holes.
	MaxTotalReorderBytes int
}

// BookStats are a Book's counters. Holes, Evictions, Resets, TrimmedPieces, Bytes and DuplicateBytes count
// since the Book was made; the others are current.
type BookStats struct {
	Flows     int // flows tracked
	Pieces    int // pieces held, open ones included
	HeldBytes int // out-of-order bytes waiting for a gap to fill
	// Holes counts gaps accepted as holes: bytes received but never recorded, which Verify reports as
	// unverified.
	Holes uint64
	// Evictions counts flows dropped for MaxFlows or MaxTotalPieces.
	Evictions uint64
	// Resets counts flows restarted because a record lay farther than any TCP window from the expected
	// byte: a new connection on a reused 4-tuple.
	Resets         uint64
	TrimmedPieces  uint64 // oldest pieces dropped for MaxPiecesPerFlow or MaxSpan
	Bytes          uint64 // bytes digested
	DuplicateBytes uint64 // bytes skipped because already digested or held
}

// Book holds, per flow, the pieces of what this host's protected sockets received. It is safe for
// concurrent use.
//
// Its bounds are shared by every protected job of the host, so a flow is evicted from the job (the cgroup
// of the receiving socket, Record.CgroupID) that holds the most: one job's many short connections, or its
// large transfers, must not evict the idle flow of another, whose record a restored peer's check of
// re-sent bytes then lacks (and the restored job is killed).
type Book struct {
	opts BookOptions

	mu     sync.Mutex
	flows  map[tcpflow.Tuple]*flow
	owners map[uint64]*owner // by cgroup id
	tick   uint64            // counts updates, to order the flows of different owners
	stats  BookStats
}

// owner is the flows of one cgroup.
type owner struct {
	cgroup uint64
	lru    *list.List // of *flow, most recently updated first
	pieces int
}

// flow is one flow's record: closed pieces, the open piece being extended, and records waiting for a gap
// before them to fill.
type flow struct {
	conn    tcpflow.Tuple
	owner   *owner
	elem    *list.Element // in owner.lru
	touched uint64        // Book.tick at the last update
	pieces  []Piece       // closed, ascending
	cur     Piece         // the open piece, ending at next, when open
	open    bool
	next    uint32 // the next byte expected in order
	first   uint32 // where the flow (or its last reset) started
	// synced says first is the connection's first byte, from a start record (its SYN): no byte of the
	// connection lies before it. Cleared once next is 2^31 past it, where serial order no longer tells.
	synced bool
	// held are copies of out-of-order bytes, all after next, ascending, not overlapping.
	held      []heldBytes
	heldBytes int
}

type heldBytes struct {
	seq  uint32
	data []byte
}

// NewBook returns an empty Book with opts' bounds.
func NewBook(opts BookOptions) *Book {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&opts.MaxPiecesPerFlow, DefaultMaxPiecesPerFlow)
	def(&opts.MaxFlows, DefaultMaxFlows)
	def(&opts.MaxReorderBytes, DefaultMaxReorderBytes)
	def(&opts.MaxTotalPieces, DefaultMaxTotalPieces)
	def(&opts.MaxTotalReorderBytes, DefaultMaxTotalReorderBytes)
	// A flow must fit what Validate accepts and what the Book may hold in all.
	opts.MaxPiecesPerFlow = min(opts.MaxPiecesPerFlow, MaxPieces, opts.MaxTotalPieces)
	return &Book{opts: opts, flows: map[tcpflow.Tuple]*flow{}, owners: map[uint64]*owner{}}
}

// Add records the payload of one received segment. rec.Payload may alias a ring buffer: only bytes that
// arrive ahead of a gap are copied (to wait for the gap to fill); in-order bytes are digested in place.
//
// Bytes in order extend the flow's open piece; bytes already digested or held (retransmissions,
// overlaps) are skipped; a record that starts after the next expected byte waits in the flow's reorder
// buffer until the gap fills (the tap may deliver a flow's records from two CPUs slightly out of order).
// If the buffer exceeds MaxReorderBytes, the gap is accepted as a hole: the run ends and a new one starts
// at the first held byte.
//
// A record without payload says where a flow's bytes begin (the tap writes one at the SYN, before any of
// the flow's data): the flow starts there, and a data record that reached the ring ahead of an earlier one
// waits for it. A flow without one starts a run at its first record's sequence number.
func (b *Book) Add(rec netlog.Record) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(rec.Payload) == 0 {
		b.begin(rec.Conn, rec.CgroupID, rec.Seq)
		return
	}
	f := b.flows[rec.Conn]
	switch {
	case f == nil:
		f = b.newFlow(rec.Conn, rec.CgroupID, rec.Seq)
	case f.owner.cgroup != rec.CgroupID:
		// Another cgroup's socket (a socket's cgroup is fixed when it is made): a new connection on the
		// reused 4-tuple, whatever its sequence numbers say. Its bytes are not the old connection's.
		b.touch(f, rec.CgroupID)
		b.reset(f, rec.Seq)
	default:
		b.touch(f, rec.CgroupID)
	}
	off := int32(rec.Seq - f.next)
	// A record before the connection's first byte (its SYN recorded) is not a retransmission: it is a new
	// connection on the reused 4-tuple whose SYN the tap missed (the consumer was gone), with an ISN behind
	// the old one's. Taken for duplicates, its bytes were dropped and the old connection's pieces served
	// as its record, so the check of its restored sender's re-sent bytes called the program nondeterministic.
	// The byte just before the first is a keepalive's (some stacks send one garbage byte at snd_una-1).
	before := off < 0 && f.synced && uint32(-off) > f.next-f.first+1
	if off < -maxWindow || off > maxWindow || before {
		b.reset(f, rec.Seq)
		off = 0
	}
	if off <= 0 {
		skip := int64(-off)
		if skip >= int64(len(rec.Payload)) {
			b.stats.DuplicateBytes += uint64(len(rec.Payload))
			return
		}
		b.stats.DuplicateBytes += uint64(skip)
		b.extend(f, rec.Payload[skip:])
		b.drain(f)
	} else {
		b.hold(f, rec.Seq, rec.Payload)
		b.overflow(f)
	}
	if f.next-f.first >= 1<<31 {
		f.synced = false
	}
	b.trim(f)
	for b.stats.Pieces > b.opts.MaxTotalPieces {
		o := b.largest(func(o *owner) int { return o.pieces })
		v := o.lru.Back().Value.(*flow)
		if v == f {
			// f's job holds the most pieces in f alone: f keeps its newest pieces (one flow is never
			// evicted for its own size), and the other jobs' flows stay.
			n := min(b.stats.Pieces-b.opts.MaxTotalPieces, len(f.pieces))
			if n == 0 {
				break
			}
			f.pieces = slices.Delete(f.pieces, 0, n)
			b.addPieces(f, -n)
			b.stats.TrimmedPieces += uint64(n)
			continue
		}
		b.drop(v)
		b.stats.Evictions++
	}
}

// begin starts conn's flow at seq. The same start again (a retransmitted SYN) changes nothing; another one
// is a new connection on the same 4-tuple.
func (b *Book) begin(conn tcpflow.Tuple, cgroup uint64, seq uint32) {
	f := b.flows[conn]
	switch {
	case f == nil:
		f = b.newFlow(conn, cgroup, seq)
	case f.first != seq || f.owner.cgroup != cgroup:
		b.touch(f, cgroup)
		b.reset(f, seq)
	default:
		return // a retransmitted SYN of a flow whose first is already its start (or past 2^31 of it)
	}
	f.synced = true
}

func (b *Book) newFlow(conn tcpflow.Tuple, cgroup uint64, seq uint32) *flow {
	for len(b.flows) >= b.opts.MaxFlows {
		b.drop(b.largest(func(o *owner) int { return o.lru.Len() }).lru.Back().Value.(*flow))
		b.stats.Evictions++
	}
	f := &flow{conn: conn, next: seq, first: seq}
	b.join(f, cgroup)
	b.flows[conn] = f
	return f
}

// join makes f, holding no piece of another owner, the most recently updated flow of cgroup's owner.
func (b *Book) join(f *flow, cgroup uint64) {
	o := b.owners[cgroup]
	if o == nil {
		o = &owner{cgroup: cgroup, lru: list.New()}
		b.owners[cgroup] = o
	}
	f.owner, f.elem = o, o.lru.PushFront(f)
	o.pieces += f.count()
	b.tick++
	f.touched = b.tick
}

// leave takes f out of its owner, forgetting an owner left without flows.
func (b *Book) leave(f *flow) {
	o := f.owner
	o.lru.Remove(f.elem)
	o.pieces -= f.count()
	if o.lru.Len() == 0 {
		delete(b.owners, o.cgroup)
	}
	f.owner, f.elem = nil, nil
}

// touch makes f the most recently updated flow, of cgroup's owner: a record of another cgroup on f's
// 4-tuple (a new connection on a reused one, which the caller resets) counts f against the job that
// receives on it now.
func (b *Book) touch(f *flow, cgroup uint64) {
	if f.owner.cgroup != cgroup {
		b.leave(f)
		b.join(f, cgroup)
		return
	}
	f.owner.lru.MoveToFront(f.elem)
	b.tick++
	f.touched = b.tick
}

// largest returns the owner with the most of size, of those equal the one whose least recently updated
// flow was updated first. There is one: the Book holds a flow.
func (b *Book) largest(size func(*owner) int) *owner {
	var best *owner
	for _, o := range b.owners {
		if best == nil {
			best = o
			continue
		}
		n, m := size(o), size(best)
		if n > m || n == m && o.lru.Back().Value.(*flow).touched < best.lru.Back().Value.(*flow).touched {
			best = o
		}
	}
	return best
}

// addPieces counts n more pieces (fewer if negative) of f, in all and in its owner's.
func (b *Book) addPieces(f *flow, n int) {
	b.stats.Pieces += n
	f.owner.pieces += n
}

// drop forgets f and its counts.
func (b *Book) drop(f *flow) {
	b.stats.Pieces -= f.count()
	b.stats.HeldBytes -= f.heldBytes
	b.leave(f)
	delete(b.flows, f.conn)
}

func (f *flow) count() int {
	n := len(f.pieces)
	if f.open {
		n++
	}
	return n
}

// reset restarts f at seq with nothing recorded.
func (b *Book) reset(f *flow, seq uint32) {
	b.addPieces(f, -f.count())
	b.stats.HeldBytes -= f.heldBytes
	b.stats.Resets++
	f.pieces, f.open, f.held, f.heldBytes = nil, false, nil, 0
	f.next, f.first, f.synced = seq, seq, false
}

// extend digests data, the bytes starting at f.next, closing a piece at each block boundary.
func (b *Book) extend(f *flow, data []byte) {
	for len(data) > 0 {
		if !f.open {
			f.cur, f.open = Piece{Seq: f.next}, true
			b.addPieces(f, 1)
		}
		n := min(BlockSize-int(f.next%BlockSize), len(data))
		f.cur.CRC = crc32.Update(f.cur.CRC, castagnoli, data[:n])
		f.cur.Len += uint32(n)
		f.next += uint32(n)
		b.stats.Bytes += uint64(n)
		data = data[n:]
		if f.next%BlockSize == 0 {
			f.pieces = append(f.pieces, f.cur)
			f.open = false
		}
	}
}

// endRun closes the open piece: a hole follows it.
func (f *flow) endRun() {
	if f.open {
		f.pieces = append(f.pieces, f.cur)
		f.open = false
	}
}

// hold copies the bytes of [seq, seq+len(data)) that no held record covers yet; seq is after f.next.
func (b *Book) hold(f *flow, seq uint32, data []byte) {
	rel := func(s uint32) int64 { return int64(s - f.next) } // every held byte lies within maxWindow after next
	s, e := rel(seq), rel(seq)+int64(len(data))
	out := make([]heldBytes, 0, len(f.held)+2)
	added := 0
	add := func(from, to int64) {
		if from >= to {
			return
		}
		out = append(out, heldBytes{seq: seq + uint32(from-s), data: slices.Clone(data[from-s : to-s])})
		added += int(to - from)
	}
	cursor := s
	for _, h := range f.held {
		hs, he := rel(h.seq), rel(h.seq)+int64(len(h.data))
		if cursor < e {
			add(cursor, min(hs, e))
		}
		out = append(out, h)
		cursor = max(cursor, he)
	}
	add(cursor, e)
	f.held = out
	f.heldBytes += added
	b.stats.HeldBytes += added
	b.stats.DuplicateBytes += uint64(len(data) - added)
}

// drain digests the held records the in-order bytes have reached.
func (b *Book) drain(f *flow) {
	for len(f.held) > 0 {
		h := f.held[0]
		off := int32(h.seq - f.next)
		if off > 0 {
			return
		}
		f.held = slices.Delete(f.held, 0, 1)
		f.heldBytes -= len(h.data)
		b.stats.HeldBytes -= len(h.data)
		if skip := int64(-off); skip < int64(len(h.data)) {
			b.stats.DuplicateBytes += uint64(skip)
			b.extend(f, h.data[skip:])
		} else {
			b.stats.DuplicateBytes += uint64(len(h.data))
		}
	}
}

// overflow accepts gaps as holes while f holds more than its share: the run ends and a new one starts at
// the first held byte.
func (b *Book) overflow(f *flow) {
	for len(f.held) > 0 && (f.heldBytes > b.opts.MaxReorderBytes || b.stats.HeldBytes > b.opts.MaxTotalReorderBytes) {
		f.endRun()
		f.next = f.held[0].seq
		b.stats.Holes++
		b.drain(f)
	}
}

// trim drops f's oldest pieces beyond MaxPiecesPerFlow or MaxSpan behind the next expected byte.
func (b *Book) trim(f *flow) {
	n := 0
	for n < len(f.pieces) && (f.count()-n > b.opts.MaxPiecesPerFlow || f.next-f.pieces[n].Seq > MaxSpan) {
		n++
	}
	if n == 0 {
		return
	}
	f.pieces = slices.Delete(f.pieces, 0, n)
	b.addPieces(f, -n)
	b.stats.TrimmedPieces += uint64(n)
}

// Received returns what the Book holds of conn from the piece holding byte from on: the pieces that end
// after from (serial order), the open piece included. ok is false if the flow is unknown.
func (b *Book) Received(conn tcpflow.Tuple, from uint32) (Received, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	f := b.flows[conn]
	if f == nil {
		return Received{}, false
	}
	after := func(p Piece) bool { return int32(p.End()-from) > 0 }
	i := sort.Search(len(f.pieces), func(i int) bool { return after(f.pieces[i]) })
	out := Received{Conn: conn, Pieces: make([]Piece, 0, len(f.pieces)-i+1)}
	out.Pieces = append(out.Pieces, f.pieces[i:]...)
	if f.open && after(f.cur) {
		out.Pieces = append(out.Pieces, f.cur)
	}
	return out, true
}

// Forget drops what the Book holds of conn (the connection is gone).
func (b *Book) Forget(conn tcpflow.Tuple) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if f := b.flows[conn]; f != nil {
		b.drop(f)
	}
}

// Stats returns the Book's counters.
func (b *Book) Stats() BookStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.stats
	s.Flows = len(b.flows)
	return s
}
