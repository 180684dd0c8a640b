package intercept

import (
	"fmt"
	"slices"
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

// DefaultMaxPerJob bounds the determinants a Store keeps of one job and host (88 bytes each in memory, so
// about 92 MB, and up to a quarter more while the array that holds them fills):
// a job that consumes more between two snapshots loses the oldest, and its replay from the older
// snapshot is refused (Since), not wrong.
const DefaultMaxPerJob = 1 << 20

// Store keeps, on a protector, the determinants of the jobs it protects: per job and host, those of the
// newest stream from some index on. Its methods may be called from any goroutine.
type Store struct {
	maxPerJob int

	mu   sync.Mutex
	recs map[storeKey]*record
}

type storeKey struct{ job, node string }

type record struct {
	stream    uint64
	fromStart bool
	base      string
	first     uint64 // index of the oldest determinant kept
	buf       []Det  // the determinants kept are buf[head:]
	head      int
}

func (r *record) dets() []Det  { return r.buf[r.head:] }
func (r *record) next() uint64 { return r.first + uint64(len(r.buf)-r.head) }

// add appends dets to the record. Dropping the oldest (dropOldest) moves nothing, it only advances head;
// the kept ones move to the front of buf when it is full and that frees a quarter of them or more, so that
// each determinant is copied about four times at most. Deleting in place instead moved the whole record
// for every batch once it had reached its bound: 8.9 ms for a batch of 100 at the default bound, 45% of a
// core on the protector for a job shipping every 20 ms.
func (r *record) add(dets []Det) {
	if len(r.buf)+len(dets) > cap(r.buf) && r.head > 0 && r.head >= (len(r.buf)-r.head)/4 {
		r.buf = r.buf[:copy(r.buf, r.dets())]
		r.head = 0
	}
	r.buf = append(r.buf, dets...)
}

// dropOldest forgets the record's n oldest determinants.
func (r *record) dropOldest(n int) {
	r.head += n
	r.first += uint64(n)
	r.fromStart = false
}

// NewStore is an empty Store keeping at most maxPerJob determinants per job and host (0: DefaultMaxPerJob).
func NewStore(maxPerJob int) *Store {
	if maxPerJob <= 0 {
		maxPerJob = DefaultMaxPerJob
	}
	return &Store{maxPerJob: maxPerJob, recs: map[storeKey]*record{}}
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
	dets := b.Dets
	switch {
	case r != nil && r.stream == b.Stream && b.First <= r.next():
		dets = b.Dets[min(r.next()-b.First, uint64(len(b.Dets))):]
	case r == nil || r.stream != b.Stream || r.next() != b.First:
		r = &record{stream: b.Stream, first: b.First, fromStart: b.FromStart && b.First == 0, base: b.Base}
		s.recs[k] = r
	}
	r.add(dets)
	if over := len(r.dets()) - s.maxPerJob; over > 0 {
		// The oldest go: the record then starts mid-stream, and a replay needs a determinant from before
		// its snapshot to know it misses nothing (Since).
		r.dropOldest(over)
	}
}

// Drop forgets every record of job.
func (s *Store) Drop(job string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k := range s.recs {
		if k.job == job {
			delete(s.recs, k)
		}
	}
}

// Len is how many determinants of job from node the store holds.
func (s *Store) Len(job, node string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.recs[storeKey{job, node}]; r != nil {
		return len(r.dets())
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
	if anchor := lastBefore(r.dets(), consumedAt(m)) - 1; anchor > 0 {
		r.dropOldest(anchor)
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
	cut := lastBefore(r.dets(), consumedAt(m))
	if cut < 0 {
		if !r.fromStart || (r.base != "" && r.base != m.ID) {
			return nil, fmt.Errorf("the determinants of job %s from %s start at number %d, and none is from before snapshot %s: some may be missing", m.Job, m.Node, r.first, m.ID)
		}
		cut = 0
	}
	return slices.Clone(r.dets()[cut:]), nil
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

// lastBefore is the index after the last determinant that consumed bytes no further than at says for its
// connection (it was recorded before the dump: consumption only grows), -1 if there is none. A
// determinant of a connection the snapshot does not hold says nothing either way, nor does a call that
// found nothing (it may have come just after the dump, at the same copied_seq).
func lastBefore(dets []Det, at map[tcpflow.Tuple]uint32) int {
	for i := len(dets) - 1; i >= 0; i-- {
		if copied, ok := at[dets[i].Conn.Unmap()]; ok && dets[i].Len > 0 && !seqAfter(dets[i].End, copied) {
			return i + 1
		}
	}
	return -1
}
