package intercept

import (
	"fmt"
	"sync"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/tcpflow"
)

// A Batch is a run of one job's determinants as the host it runs on ships them to its protector.
type Batch struct {
	Job string
	// Stream names one recording of the job on its host (a new one each time the host's agent starts
	// recording the job); First is the index of Dets[0] in it.
	Stream uint64
	First  uint64
	// FromStart says the stream began before the job's processes ran on the host (its start, or its
	// restore from Base): nothing the job consumed there is missing before index 0. False when the agent
	// attached to a running job (after its own restart).
	FromStart bool
	// Base is the snapshot the job was restored from on the host, "" for a job started there.
	Base string
	Dets []Det
}

// DefaultMaxPerJob bounds the determinants a Store keeps of one job and host (32 bytes each in memory, so
// 32 MiB, and up to a quarter more while the array that holds them fills):
// a job that consumes more between two snapshots loses the oldest, and its replay from the older
// snapshot is refused (Since), not wrong.
const DefaultMaxPerJob = 1 << 20

// DefaultMaxTotal bounds the determinants a Store keeps in all (256 MiB). Beyond it the records that
// received nothing for longest go whole: those of jobs that ended (nothing tells a protector so, and a
// member could otherwise fill its memory with records of made-up jobs). A job whose record went is
// restored without its receive order replayed, which a recovery says (Since), never wrongly.
const DefaultMaxTotal = 8 << 20

// DefaultMaxRecords bounds the records (jobs and hosts) a Store keeps, whatever they hold: a batch without a
// determinant (a job that received nothing yet) makes a record that counts nothing against DefaultMaxTotal,
// so a member sending empty batches of made-up jobs would otherwise grow the map by one record (a few
// hundred bytes) a batch for good. Beyond it the records that received nothing for longest go, as above.
const DefaultMaxRecords = 1 << 16

// Store keeps, on a protector, the determinants of the jobs it protects: per job and host, those of the
// newest stream from some index on. Its methods may be called from any goroutine.
type Store struct {
	maxPerJob, maxTotal int
	maxRecords          int

	mu    sync.Mutex
	recs  map[storeKey]*record
	total int    // determinants kept in all records
	adds  uint64 // counts Add calls: a record's used is the count at its last one
}

type storeKey struct{ job, node string }

// keptDet is a determinant as a record keeps it: its connection is an index into the record's table. Unlike
// a Det (88 bytes, with the pointers of its addresses' zones) it holds no pointer, so that a record of a
// million takes 32 MiB and the garbage collector never scans it. Keeping Dets, the protector of a job
// receiving a million 64-byte messages spent a fifth of its CPU growing, zeroing and scanning the arrays
// (ftbench receive-order's message stream, docs/receive-order.md).
type keptDet struct {
	pos                    uint64
	end, len, thread, proc uint32
	conn                   uint32 // index in record.conns
}

type record struct {
	stream    uint64
	fromStart bool
	base      string
	first     uint64    // index of the oldest determinant kept
	buf       []keptDet // the determinants kept are buf[head:]
	head      int
	conns     []tcpflow.Tuple          // the connections the kept name, by index
	connIdx   map[tcpflow.Tuple]uint32 // and their indexes
	used      uint64                   // Store.adds at the record's last Add
	// ends is, per 4-tuple whose calls were dropped (dropOldest), where the last of them that consumed
	// bytes ended: the proof lastBefore needs that a later call on the 4-tuple consuming from before it is
	// of a new connection. Without it a Trim took that proof away, and the next Since took the new
	// connection's call for the anchor. endsLost: more than maxEnds were needed, and some went.
	ends     map[tcpflow.Tuple]uint32
	endsLost bool
}

// maxEnds bounds record.ends (a few MiB): a record that would need more vouches for no snapshot any more
// (lastBefore), refused rather than guessed.
const maxEnds = 1 << 16

func (r *record) kept() []keptDet { return r.buf[r.head:] }
func (r *record) next() uint64    { return r.first + uint64(len(r.buf)-r.head) }

// det is k as a Det.
func (r *record) det(k keptDet) Det {
	return Det{Conn: r.conns[k.conn], End: k.end, Len: k.len, Thread: k.thread, Proc: k.proc, Pos: k.pos}
}

// dets are the determinants kept from index i of kept() on.
func (r *record) dets(i int) []Det {
	ks := r.kept()[i:]
	out := make([]Det, len(ks))
	for j, k := range ks {
		out[j] = r.det(k)
	}
	return out
}

// add appends dets to the record. Dropping the oldest (dropOldest) moves nothing, it only advances head;
// the kept ones move to the front of buf when it is full and that frees a quarter of them or more, so that
// each determinant is copied about four times at most. Deleting in place instead moved the whole record
// for every batch once it had reached its bound: 8.9 ms for a batch of 100 at the default bound, 45% of a
// core on the protector for a job shipping every 20 ms.
func (r *record) add(dets []Det) {
	if len(r.buf)+len(dets) > cap(r.buf) && r.head > 0 && r.head >= (len(r.buf)-r.head)/4 {
		r.buf = r.buf[:copy(r.buf, r.kept())]
		r.head = 0
		r.shrinkConns()
	}
	if r.connIdx == nil {
		r.connIdx = map[tcpflow.Tuple]uint32{}
	}
	var last tcpflow.Tuple
	var lastIdx uint32
	for i, d := range dets {
		if i == 0 || d.Conn != last { // a batch is mostly runs of one connection
			idx, ok := r.connIdx[d.Conn]
			if !ok {
				idx = uint32(len(r.conns))
				r.conns = append(r.conns, d.Conn)
				r.connIdx[d.Conn] = idx
			}
			last, lastIdx = d.Conn, idx
		}
		r.buf = append(r.buf, keptDet{pos: d.Pos, end: d.End, len: d.Len, thread: d.Thread, proc: d.Proc, conn: lastIdx})
	}
}

// shrinkConns drops the connections no kept determinant names any more, once the table holds more than 64 and
// more than an eighth as many as the determinants kept: a job that opens connection after connection would
// otherwise grow it for good.
func (r *record) shrinkConns() {
	ks := r.kept()
	if len(r.conns) <= 64 || len(r.conns) <= len(ks)/8 {
		return
	}
	renum := make(map[uint32]uint32)
	var conns []tcpflow.Tuple
	for i := range ks {
		idx, ok := renum[ks[i].conn]
		if !ok {
			idx = uint32(len(conns))
			conns = append(conns, r.conns[ks[i].conn])
			renum[ks[i].conn] = idx
		}
		ks[i].conn = idx
	}
	r.conns, r.connIdx = conns, make(map[tcpflow.Tuple]uint32, len(conns))
	for i, c := range conns {
		r.connIdx[c] = uint32(i)
	}
}

// dropOldest forgets the record's n oldest determinants, keeping where each 4-tuple's last one that
// consumed bytes ended (ends).
func (r *record) dropOldest(n int) {
	if r.ends == nil && !r.endsLost {
		r.ends = map[tcpflow.Tuple]uint32{}
	}
	ks := r.kept()[:n]
	for i, k := range ks {
		// Only the last call of a run on one connection (batches are mostly such runs) updates the map.
		if k.len > 0 && !r.endsLost && (i+1 == len(ks) || ks[i+1].conn != k.conn || ks[i+1].len == 0) {
			r.ends[r.conns[k.conn]] = k.end
		}
	}
	r.boundEnds()
	r.head += n
	r.first += uint64(n)
	r.fromStart = false
}

// NewStore is an empty Store keeping at most maxPerJob determinants per job and host (0: DefaultMaxPerJob)
// and maxTotal in all (0: DefaultMaxTotal).
func NewStore(maxPerJob, maxTotal int) *Store {
	if maxPerJob <= 0 {
		maxPerJob = DefaultMaxPerJob
	}
	if maxTotal <= 0 {
		maxTotal = DefaultMaxTotal
	}
	return &Store{maxPerJob: maxPerJob, maxTotal: maxTotal, maxRecords: DefaultMaxRecords, recs: map[storeKey]*record{}}
}

// Add stores a batch node sent. A batch of another stream replaces the job's record from node; one that
// does not continue the record (the host lost determinants, or a batch was lost) starts it over at its own
// first index, so that Since never bridges a hole. A batch the record already holds in part (the host sends
// again what it did not see answered) adds only the rest.
func (s *Store) Add(node string, b Batch) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := storeKey{b.Job, node}
	r := s.recs[k]
	if r != nil {
		s.total -= len(r.kept())
	}
	dets := b.Dets
	switch {
	case r != nil && r.stream == b.Stream && b.First <= r.next():
		dets = b.Dets[min(r.next()-b.First, uint64(len(b.Dets))):]
	case r == nil || r.stream != b.Stream || r.next() != b.First:
		r = &record{stream: b.Stream, first: b.First, fromStart: b.FromStart && b.First == 0, base: b.Base}
		s.recs[k] = r
	}
	r.add(dets)
	if over := len(r.kept()) - s.maxPerJob; over > 0 {
		// The oldest go: the record then starts mid-stream, and a replay needs a determinant from before
		// its snapshot to know it misses nothing (Since).
		r.dropOldest(over)
	}
	s.adds++
	r.used = s.adds
	s.total += len(r.kept())
	for s.total > s.maxTotal || len(s.recs) > s.maxRecords {
		var oldest storeKey
		for ok, or := range s.recs {
			if ok != k && (oldest == (storeKey{}) || or.used < s.recs[oldest].used) {
				oldest = ok
			}
		}
		if oldest == (storeKey{}) {
			break // the record just added is alone: maxPerJob bounds it
		}
		s.total -= len(s.recs[oldest].kept())
		delete(s.recs, oldest)
	}
}

// Drop forgets the record of job from node (the job ended there).
func (s *Store) Drop(job, node string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := storeKey{job, node}
	if r := s.recs[k]; r != nil {
		s.total -= len(r.kept())
		delete(s.recs, k)
	}
}

// Len is how many determinants of job from node the store holds.
func (s *Store) Len(job, node string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.recs[storeKey{job, node}]; r != nil {
		return len(r.kept())
	}
	return 0
}

// Trim drops the determinants of job from node that a newer snapshot m (taken on node) has made useless:
// all before the last one m's connections had consumed, which stays as the proof that the record reaches
// back to m (Since).
func (s *Store) Trim(m *ckpt.Manifest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.recs[storeKey{m.Job, m.Node}]
	if r == nil {
		return
	}
	at := consumedAt(m)
	if anchor := r.lastBefore(at) - 1; anchor > 0 {
		r.dropOldest(anchor)
		s.total -= anchor
		// Only the 4-tuples m holds keep their proof: a connection of a later snapshot that m does not hold
		// began after m's dump, after every call dropped here, and another's calls would say nothing of it.
		for c := range r.ends {
			if _, ok := at[c.Unmap()]; !ok {
				delete(r.ends, c)
			}
		}
	}
}

// boundEnds gives up ends once it holds more than maxEnds 4-tuples (a job that opened that many
// connections since its last snapshot): lastBefore then vouches for no snapshot.
func (r *record) boundEnds() {
	if len(r.ends) > maxEnds {
		r.ends, r.endsLost = nil, true
	}
}

// Since is what job consumed on node after snapshot m (taken there) was dumped, in order. It fails,
// saying why, unless the record provably misses none of them: it must hold a determinant from before the
// dump (one that consumed no further than m's copied_seq of its connection), or have started with the
// stream, before the job ran from m (or from its start) on node.
func (s *Store) Since(m *ckpt.Manifest) ([]Det, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.recs[storeKey{m.Job, m.Node}]
	if r == nil {
		return nil, fmt.Errorf("no determinants of job %s from %s here", m.Job, m.Node)
	}
	cut := r.lastBefore(consumedAt(m))
	if cut < 0 {
		if !r.fromStart || (r.base != "" && r.base != m.ID) {
			return nil, fmt.Errorf("the determinants of job %s from %s start at number %d, and none is from before snapshot %s: some may be missing", m.Job, m.Node, r.first, m.ID)
		}
		cut = 0
	}
	if r.base == m.ID {
		// A copy restored from m on node: its Pos count from that restore, as those of a copy on another host
		// (SinceOn). Returned as recorded, the gate took m.Polls off them once too many.
		return onSnapshotCount(m, r.dets(cut)), nil
	}
	return r.dets(cut), nil
}

// SinceOn is what m's job consumed after m was dumped when it last ran from m on host ran: restored there
// from m, it failed before a snapshot of its own was replicated, and m is restored again. ran's copy
// first replayed m's host's record (Since), then read on by itself, sending what its peers took in; its own
// record starts at m. Once that record has gone past the end of the other on each connection, it holds the
// order of both and it is the one to replay; while it has not, the copy was still replaying, and the other
// holds all it did and more. Since(m) alone replayed the original's order and let the job read on freely
// where ran's copy had read in an order its peers depended on. It fails, saying why, when it cannot tell
// which holds the order: ran's record not from the start of a copy restored from m, or the two gone apart.
// With no record from ran here (its copy shipped nothing here), and with ran "" or m.Node, it is Since.
// Either way their Pos count as on m's host, from which the gate takes m.Polls off: a copy's, counted from
// its restore (Since's too, for a copy restored from m on m's host), are put on that count (onSnapshotCount).
func (s *Store) SinceOn(m *ckpt.Manifest, ran string) ([]Det, error) {
	orig, err := s.Since(m)
	if ran == "" || ran == m.Node {
		return orig, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.recs[storeKey{m.Job, ran}]
	switch {
	case r == nil:
		return orig, err
	case r.base != m.ID || !r.fromStart:
		return nil, fmt.Errorf("job %s last ran on %s, restored from snapshot %s, and the determinants of it from there are not of that copy from its start (restored from %q, from number %d): some may be missing", m.Job, ran, m.ID, r.base, r.first)
	case err != nil:
		return nil, fmt.Errorf("job %s last ran on %s from snapshot %s, whose copy replayed the determinants of %s first: %w", m.Job, ran, m.ID, m.Node, err)
	}
	own := r.dets(0)
	origEnd, ownEnd := lastEnds(orig), lastEnds(own)
	var ahead, behind bool
	for c, e := range origEnd {
		if o, ok := ownEnd[c]; !ok || seqAfter(e, o) {
			behind = true
		}
	}
	for c, o := range ownEnd {
		if e, ok := origEnd[c]; !ok || seqAfter(o, e) {
			ahead = true
		}
	}
	switch {
	case !behind:
		return onSnapshotCount(m, own), nil
	case !ahead:
		return orig, nil
	}
	return nil, fmt.Errorf("job %s last ran on %s from snapshot %s, and its receive calls there went apart from those of %s after the snapshot (ahead on one connection, behind on another): which order its peers depend on is unknown", m.Job, ran, m.ID, m.Node)
}

// onSnapshotCount puts the Pos of dets, those of a copy restored from m on another host, on the count of
// m's host. The copy's recorder counted each thread's readiness calls from 0 at its restore (record.Watch
// forgets the cgroup's counts), so its Pos are already counted from the dump; a gate takes m.Polls off
// every Pos (Gate.UsePositions), as it must off those of m's host. Returned as they were, they had the
// counts at m's dump taken off them too: a gate refused positions ("fewer than ... at the dump") or, with
// few readiness calls before the dump, stopped the restored threads at the wrong calls, silently. A sum
// that overflows wraps below m.Polls, and the gate refuses positions.
func onSnapshotCount(m *ckpt.Manifest, dets []Det) []Det {
	if !m.Positions {
		return dets
	}
	for i := range dets {
		if dets[i].Pos != NoPos { // the copy's host counted nothing: the gate refuses positions
			dets[i].Pos += m.Polls[dets[i].Thread]
		}
	}
	return dets
}

// lastEnds is where the last call of dets that consumed bytes ended, per connection.
func lastEnds(dets []Det) map[tcpflow.Tuple]uint32 {
	out := map[tcpflow.Tuple]uint32{}
	for _, d := range dets {
		if d.Len > 0 {
			out[d.Conn.Unmap()] = d.End
		}
	}
	return out
}

// consumedAt is, per connection of m, the socket's copied_seq at the dump: every byte before the receive
// queue's.
func consumedAt(m *ckpt.Manifest) map[tcpflow.Tuple]uint32 {
	at := make(map[tcpflow.Tuple]uint32, len(m.Conns))
	for _, c := range m.Conns {
		if c.Connecting {
			continue // its InqSeq is the kernel's 0: it says nothing of what the job consumed after
		}
		at[c.Tuple.Unmap()] = c.InqSeq - c.InqLen
	}
	return at
}

// lastBefore is the index in kept() after the last determinant that consumed bytes no further than at
// says for its connection (it was recorded before the dump: consumption only grows), -1 if there is none. A
// determinant of a connection the snapshot does not hold says nothing either way, nor does a call that
// found nothing (it may have come just after the dump, at the same copied_seq), nor one on a 4-tuple after
// a call on it that consumed from before where an earlier one had ended, or that jumped ahead of it back to
// no further than at after a call went past at: consumption on one connection only grows, call by call, so
// from there on the 4-tuple is a new connection (the snapshot's closed after the dump), whose sequence
// numbers say nothing of the dump. Taken for an anchor, such a call cut off the calls of other
// connections between the dump and it, and the replay went without them.
func (r *record) lastBefore(at map[tcpflow.Tuple]uint32) int {
	type consumed struct {
		seq uint32
		ok  bool
		// end is where the last call on the 4-tuple ended (set: one was seen), and broke the index of the
		// first call that consumed from before it (-1: none).
		end   uint32
		set   bool
		broke int
		// crossed: a call consumed from no further than seq to past it, the first after the dump. A later
		// call that jumps ahead of where the last ended and ends no further than seq again is of a new
		// connection whose sequence numbers start ahead (less than 2^31 after the old end, 2^31 or more
		// after seq): consumption that grows call by call gets there only 2 GiB after the dump, never by a
		// jump.
		crossed bool
	}
	if r.endsLost {
		return -1 // a call of a new connection on a 4-tuple can no longer be told from the snapshot's
	}
	byIdx := make([]consumed, len(r.conns))
	for i, c := range r.conns {
		byIdx[i].seq, byIdx[i].ok = at[c.Unmap()]
		byIdx[i].broke = -1
		byIdx[i].end, byIdx[i].set = r.ends[c] // where its dropped calls ended, if any were
	}
	ks := r.kept()
	for i, k := range ks {
		c := &byIdx[k.conn]
		if !c.ok || k.len == 0 || c.broke >= 0 {
			continue
		}
		start := k.end - k.len
		if c.set && (seqAfter(c.end, start) || start != c.end && c.crossed && !seqAfter(k.end, c.seq)) {
			c.broke = i
			continue
		}
		if !seqAfter(start, c.seq) && seqAfter(k.end, c.seq) {
			c.crossed = true
		}
		c.end, c.set = k.end, true
	}
	for i := len(ks) - 1; i >= 0; i-- {
		c := byIdx[ks[i].conn]
		if c.ok && ks[i].len > 0 && (c.broke < 0 || i < c.broke) && !seqAfter(ks[i].end, c.seq) {
			return i + 1
		}
	}
	return -1
}
