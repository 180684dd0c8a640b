package record

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"reflect"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/tcpflow"
)

// fakeStream is a determinant stream into a protector's store: each batch is stored as it comes, as the
// protector does, until the stream breaks.
type fakeStream struct {
	store  *intercept.Store
	asked  []bool // per batch sent: did it ask for an answer
	broken bool   // batches from now on are lost and Send fails
}

func (f *fakeStream) Send(_ context.Context, req clusterapi.DeterminantsRequest) error {
	if f.broken {
		return &clusterapi.StreamError{Op: clusterapi.OpDeterminantStream2, Peer: "n2", Err: errors.New("connection reset")}
	}
	f.asked = append(f.asked, req.Ack)
	b, err := req.Batch()
	if err != nil {
		return err
	}
	f.store.Add("n1", b)
	return nil
}

func (f *fakeStream) Stale() bool  { return false }
func (f *fakeStream) Close() error { return nil }

// TestShipAsksForAnswersNowAndThen: a job's batches go on its protector's stream without waiting for an
// answer, except the first, one that a held process waits for, and one every answerEvery (answers cost the
// protector as much as the batches). What a broken stream carried unanswered goes again on the next, and
// the protector's record stays whole: every determinant once, in order, from the job's start.
func TestShipAsksForAnswersNowAndThen(t *testing.T) {
	ctx := t.Context()
	store := intercept.NewStore(0, 0)
	var opened []*fakeStream
	r := newTestRecorder()
	r.answerEvery = time.Hour // only the test makes an answer due
	r.protector = func(string) (string, bool) { return "n2", true }
	r.open = func(context.Context, string) (detStream, error) {
		f := &fakeStream{store: store}
		opened = append(opened, f)
		return f, nil
	}
	s := &stream{job: "j", cgroup: 7, id: 1, fromStart: true, watchers: map[chan intercept.Event]bool{}}
	r.byJob["j"], r.byCgroup[7] = s, s
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	var all []intercept.Det
	receive := func(n int) {
		for range n {
			d := intercept.Det{Conn: conn, End: uint32(len(all)+1) * 10, Len: 10, Thread: 1, Proc: 1, Pos: intercept.NoPos} // the test's recorder counts no readiness calls
			all = append(all, d)
			r.mu.Lock()
			r.take(ebpfprobes.RecvEvent{Cgroup: 7, Conn: d.Conn, CopiedSeq: d.End, Len: d.Len, Thread: d.Thread, Proc: d.Proc, Pid: 100}, time.Now())
			r.mu.Unlock()
		}
	}
	ship := func(step string, wantAsked []bool, wantPending, wantStored int) {
		t.Helper()
		r.shipStream(ctx, s)
		f := opened[len(opened)-1]
		if !reflect.DeepEqual(f.asked, wantAsked) {
			t.Errorf("%s: batches on stream %d asked for answers %v, want %v", step, len(opened), f.asked, wantAsked)
		}
		if len(s.pending) != wantPending {
			t.Errorf("%s: %d determinants wait for an answer, want %d", step, len(s.pending), wantPending)
		}
		if got := store.Len("j", "n1"); got != wantStored {
			t.Errorf("%s: the protector holds %d determinants, want %d", step, got, wantStored)
		}
	}

	receive(2)
	ship("the first batch", []bool{true}, 0, 2)
	receive(3)
	ship("the next", []bool{true, false}, 3, 5)
	receive(1)
	ship("one more", []bool{true, false, false}, 4, 6)

	opened[0].broken = true
	receive(2)
	ship("on a broken stream", []bool{true, false, false}, 6, 6)
	// The next round opens a new stream and sends every unanswered determinant again: the protector adds
	// what it lacked and keeps the rest.
	ship("on a new stream", []bool{false}, 6, 8)
	if len(opened) != 2 {
		t.Fatalf("%d streams opened, want 2", len(opened))
	}

	// A held process waits for its determinant to be stored: its batch asks, and the answer releases it.
	r.mu.Lock()
	s.held = []heldProc{{pid: 1 << 30, upTo: s.first + uint64(len(s.pending)) + 1}} // no such process: continuing it is a no-op
	r.mu.Unlock()
	receive(1)
	ship("a held process", []bool{false, true}, 0, 9)
	if len(s.held) != 0 {
		t.Errorf("held %v after the answer", s.held)
	}

	// With nothing new, an answer falls due all the same (an empty batch asks), so that nothing stays
	// unanswered for long.
	receive(1)
	ship("unanswered", []bool{false, true, false}, 1, 10)
	if again := r.shipStream(ctx, s); again <= 0 || again > r.answerEvery {
		t.Errorf("with one determinant unanswered and its answer not due, come back in %s", again)
	}
	s.answeredAt = time.Time{}
	ship("an answer due", []bool{false, true, false, true}, 0, 10)
	if again := r.shipStream(ctx, s); again != 0 {
		t.Errorf("with every determinant answered, come back in %s; want never", again)
	}

	got, err := store.Since(&ckpt.Manifest{ID: "s", Job: "j", Node: "n1", Info: ckpt.Info{Conns: []ckpt.Conn{{Tuple: conn}}}})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, all) {
		t.Errorf("the protector's record:\n%v\nwant\n%v", got, all)
	}
}

// TestForgetSent: an answer drops the determinants it covers and moves the unanswered rest to the front of
// the same array, which the next calls fill again (reslicing made append allocate a fresh array after
// every answer); an array a burst left much larger than its rest is given back.
func TestForgetSent(t *testing.T) {
	dets := func(n, cap_ int) []intercept.Det {
		out := make([]intercept.Det, n, cap_)
		for i := range out {
			out[i].End = uint32(i)
		}
		return out
	}
	for _, tc := range []struct {
		name          string
		pending       []intercept.Det
		sent          int
		wantSameArray bool
		wantCapAtMost int
	}{
		{"rest moved to the front", dets(10, 100), 6, true, 100},
		{"everything answered", dets(10, 100), 10, true, 100},
		{"a burst's array given back", dets(3*maxUnanswered, 3*maxUnanswered), 3*maxUnanswered - 5, false, 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := &tc.pending[:1][0]
			rest := slices.Clone(tc.pending[tc.sent:])
			s := &stream{pending: tc.pending, sent: tc.sent}
			s.forgetSent()
			if !reflect.DeepEqual(s.pending, rest) {
				t.Errorf("pending %v, want the %d unanswered %v", s.pending, len(rest), rest)
			}
			if same := cap(s.pending) > 0 && &s.pending[:1][0] == base; same != tc.wantSameArray {
				t.Errorf("the same array kept: %v, want %v", same, tc.wantSameArray)
			}
			if cap(s.pending) > tc.wantCapAtMost {
				t.Errorf("capacity %d, want at most %d", cap(s.pending), tc.wantCapAtMost)
			}
		})
	}
}

// TestShipBatchOfManyConnections: a job that read more connections in one round than a batch may name (a
// server with thousands of clients) still ships all its determinants, in batches that name at most
// intercept.MaxConns connections each. A batch of them all could not be packed, and was tried again every
// round for good: nothing more of the job reached its protector (and a held process was never released).
func TestShipBatchOfManyConnections(t *testing.T) {
	ctx := t.Context()
	store := intercept.NewStore(0, 0)
	r := newTestRecorder()
	r.protector = func(string) (string, bool) { return "n2", true }
	r.open = func(context.Context, string) (detStream, error) { return &fakeStream{store: store}, nil }
	s := &stream{job: "j", cgroup: 7, id: 1, fromStart: true, watchers: map[chan intercept.Event]bool{}}
	r.byJob["j"], r.byCgroup[7] = s, s
	var all []intercept.Det
	var conns []ckpt.Conn
	for i := range intercept.MaxConns + 10 {
		c := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.1"), uint16(10000+i))}
		conns = append(conns, ckpt.Conn{Tuple: c})
		d := intercept.Det{Conn: c, End: 10, Len: 10, Thread: 1, Proc: 1, Pos: intercept.NoPos} // the test's recorder counts no readiness calls
		all = append(all, d)
		r.mu.Lock()
		r.take(ebpfprobes.RecvEvent{Cgroup: 7, Conn: d.Conn, CopiedSeq: d.End, Len: d.Len, Thread: d.Thread, Proc: d.Proc, Pid: 100}, time.Now())
		r.mu.Unlock()
	}
	for range 4 {
		r.shipStream(ctx, s)
	}
	if got := store.Len("j", "n1"); got != len(all) {
		t.Fatalf("the protector holds %d of the job's %d determinants", got, len(all))
	}
	got, err := store.Since(&ckpt.Manifest{ID: "s", Job: "j", Node: "n1", Info: ckpt.Info{Conns: conns}})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, all) {
		t.Errorf("the protector's record differs from what the job read (%d determinants, want %d)", len(got), len(all))
	}
}

// refusingStream is a protector's stream that refuses every batch holding a determinant of conn (as an
// agent of another version refuses every batch, or one refused a batch it could not store): it stores
// none of that batch and ends the stream.
type refusingStream struct {
	fakeStream
	refuse tcpflow.Tuple
}

func (f *refusingStream) Send(ctx context.Context, req clusterapi.DeterminantsRequest) error {
	b, err := req.Batch()
	if err != nil {
		return err
	}
	for _, d := range b.Dets {
		if d.Conn == f.refuse {
			return &clusterapi.Error{Code: clusterapi.CodeRefused, Op: clusterapi.OpDeterminantStream3, Peer: "n2", Message: "determinants of job j: refused"}
		}
	}
	return f.fakeStream.Send(ctx, req)
}

// errorLogs counts the records logged at level Error or above.
type errorLogs struct {
	slog.Handler
	n *atomic.Int64
}

func (h errorLogs) Enabled(context.Context, slog.Level) bool { return true }
func (h errorLogs) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError {
		h.n.Add(1)
	}
	return nil
}
func (h errorLogs) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h errorLogs) WithGroup(string) slog.Handler      { return h }

// TestShipRefusedBatch: a batch the protector refuses (it answers so, and would refuse it again) is not
// sent again for good. It was: logged at debug level only, every round, while the job's later determinants
// waited behind it (none reached the protector until a million had piled up) and a process held for one of
// them stayed stopped for good. Now the refusal is an error in the log, the job's record has a hole there
// (a replay from before it is refused, as for lost calls), the held processes go on, and what the job
// reads next is shipped.
func TestShipRefusedBatch(t *testing.T) {
	ctx := t.Context()
	store := intercept.NewStore(0, 0)
	bad := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5002"), Remote: netip.MustParseAddrPort("10.0.0.1:40001")}
	good := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	var errs atomic.Int64
	r := newRecorder(Options{ShipEvery: DefaultShipEvery, Logger: slog.New(errorLogs{n: &errs})})
	r.protector = func(string) (string, bool) { return "n2", true }
	r.open = func(context.Context, string) (detStream, error) {
		return &refusingStream{fakeStream: fakeStream{store: store}, refuse: bad}, nil
	}
	s := &stream{job: "j", cgroup: 7, id: 1, fromStart: true, watchers: map[chan intercept.Event]bool{}}
	r.byJob["j"], r.byCgroup[7] = s, s
	receive := func(c tcpflow.Tuple, end uint32, held bool) {
		r.mu.Lock()
		r.take(ebpfprobes.RecvEvent{Cgroup: 7, Conn: c, CopiedSeq: end, Len: 10, Thread: 1, Proc: 1, Pid: 1 << 30, Held: held}, time.Now())
		r.mu.Unlock()
	}
	receive(good, 10, false)
	receive(bad, 10, true) // no such process: continuing it is a no-op
	for range 3 {
		r.shipStream(ctx, s)
	}
	if len(s.held) != 0 {
		t.Errorf("a process held for a determinant its protector refused is still held: %v", s.held)
	}
	if errs.Load() == 0 {
		t.Error("the protector's refusal was not logged as an error")
	}
	receive(good, 20, false)
	for range 3 {
		r.shipStream(ctx, s)
	}
	if got := store.Len("j", "n1"); got != 1 {
		t.Errorf("the protector holds %d determinants of the job, want the one read after the refused batch", got)
	}
}

// TestLostUnreadNotShipped: a job lost calls while calls recorded before them were still in the ring
// (TestLostAfterUnreadCallsMakesHoleAfterThem). What it takes until a read has drained them may hold calls
// from both sides of the lost one: shipped, the protector's record bridged the loss until the next batch
// started it over, and a recovery in between replayed it as complete.
func TestLostUnreadNotShipped(t *testing.T) {
	store := intercept.NewStore(0, 0)
	r := newTestRecorder()
	r.protector = func(string) (string, bool) { return "n2", true }
	r.open = func(context.Context, string) (detStream, error) { return &fakeStream{store: store}, nil }
	r.lostOf = func(uint64) (uint64, error) { return 1, nil }
	s := &stream{job: "j", cgroup: 7, id: 1, fromStart: true, watchers: map[chan intercept.Event]bool{}}
	r.byJob["j"], r.byCgroup[7] = s, s
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	r.mu.Lock()
	r.noticeLost()                                                                                    // the loss, seen after a read that left calls in the ring
	r.take(ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Len: 10, Pid: 100}, time.Now()) // recorded before the loss
	r.take(ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 30, Len: 10, Pid: 100}, time.Now()) // after it
	r.mu.Unlock()
	r.shipStream(t.Context(), s)
	if n := store.Len("j", "n1"); n != 0 {
		t.Fatalf("the protector holds %d determinants taken before the ring's calls from before the loss were read", n)
	}
}
