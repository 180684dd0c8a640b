package detect

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

// step is one call on the watchdog at t0+ms. For "suspects", want lists the expected suspects as
// "name/silence-ms/lastbeat-ms/jobs" (lastbeat -1: never heard).
type step struct {
	ms   int
	op   string // watch, unwatch, beat, clear, suspects
	name string
	seq  uint64
	sent int // ms, sender's clock
	busy string
	jobs []string
	want []string
}

func TestWatchdog(t *testing.T) {
	cfg := Config{Timeout: 3 * time.Second, BusyGrace: 10 * time.Second}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"beats keep it quiet", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 1000, op: "beat", name: "n1", seq: 1, sent: 1000, jobs: []string{"j1"}},
			{ms: 3500, op: "suspects"},
			{ms: 4000, op: "beat", name: "n1", seq: 2, sent: 4000, jobs: []string{"j1"}},
			{ms: 7000, op: "suspects"}, // exactly Timeout: not yet
		}},
		{"silence after beats", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 1000, op: "beat", name: "n1", seq: 1, sent: 1000, jobs: []string{"j1", "j2"}},
			{ms: 4001, op: "suspects", want: []string{"n1/3001/1000/j1,j2"}},
			{ms: 9000, op: "suspects"}, // reported once
		}},
		{"never heard: silence counts from watch", []step{
			{ms: 500, op: "watch", name: "n1"},
			{ms: 3500, op: "suspects"},
			{ms: 3501, op: "suspects", want: []string{"n1/3001/-1/"}},
		}},
		{"watch restarts silence despite an older beat", []step{
			{ms: 0, op: "beat", name: "n1", seq: 1, sent: 0},
			{ms: 5000, op: "watch", name: "n1"},
			{ms: 7000, op: "suspects"},
			{ms: 8001, op: "suspects", want: []string{"n1/3001/0/"}},
		}},
		{"re-watch ends a suspicion", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 4000, op: "suspects", want: []string{"n1/4000/-1/"}},
			{ms: 4000, op: "watch", name: "n1"},
			{ms: 7001, op: "suspects", want: []string{"n1/3001/-1/"}},
		}},
		// A busy member is suspected at the timeout like any other, in grace until Timeout+BusyGrace
		// after its last beat (the caller checks its host then, and clears a host that answers).
		{"busy beat: suspected in grace", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 0, op: "beat", name: "n1", seq: 1, sent: 0, busy: BusyCheckpoint},
			{ms: 3000, op: "suspects"},
			{ms: 3001, op: "suspects", want: []string{"n1/3001/0/ checkpoint in grace"}},
			{ms: 3001, op: "clear", name: "n1"},
			{ms: 13000, op: "suspects", want: []string{"n1/9999/0/ checkpoint in grace"}},
			{ms: 13000, op: "clear", name: "n1"},
			{ms: 16001, op: "suspects", want: []string{"n1/3001/0/ checkpoint"}},
		}},
		{"not busy any more", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 0, op: "beat", name: "n1", seq: 1, sent: 0, busy: BusyRestore},
			{ms: 1000, op: "beat", name: "n1", seq: 2, sent: 1000},
			{ms: 4001, op: "suspects", want: []string{"n1/3001/1000/"}},
		}},
		{"new beat ends a suspicion", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 3001, op: "suspects", want: []string{"n1/3001/-1/"}},
			{ms: 3500, op: "beat", name: "n1", seq: 1, sent: 3500, jobs: []string{"j"}},
			{ms: 6500, op: "suspects"},
			{ms: 6501, op: "suspects", want: []string{"n1/3001/3500/j"}},
		}},
		{"clear restarts silence", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 0, op: "beat", name: "n1", seq: 1, sent: 0, jobs: []string{"j"}},
			{ms: 3001, op: "suspects", want: []string{"n1/3001/0/j"}},
			{ms: 5000, op: "clear", name: "n1"},
			{ms: 8000, op: "suspects"},
			{ms: 8001, op: "suspects", want: []string{"n1/3001/0/j"}},
		}},
		{"clear of an unwatched name does nothing", []step{
			{ms: 0, op: "clear", name: "n9"},
			{ms: 10000, op: "suspects"},
		}},
		{"unwatched is never suspected", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 0, op: "watch", name: "n2"},
			{ms: 1000, op: "unwatch", name: "n1"},
			{ms: 5000, op: "suspects", want: []string{"n2/5000/-1/"}},
		}},
		{"several suspects sorted", []step{
			{ms: 0, op: "watch", name: "n3"},
			{ms: 0, op: "watch", name: "n1"},
			{ms: 0, op: "watch", name: "n2"},
			{ms: 2000, op: "beat", name: "n2", seq: 1, sent: 2000},
			{ms: 3500, op: "suspects", want: []string{"n1/3500/-1/", "n3/3500/-1/"}},
			{ms: 5001, op: "suspects", want: []string{"n2/3001/2000/"}},
		}},
		{"duplicate and reordered beats ignored", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 1000, op: "beat", name: "n1", seq: 5, sent: 1000, jobs: []string{"new"}},
			{ms: 3000, op: "beat", name: "n1", seq: 4, sent: 500, jobs: []string{"old"}, busy: BusyCheckpoint},
			{ms: 3500, op: "beat", name: "n1", seq: 5, sent: 1000, jobs: []string{"dup"}},
			{ms: 4001, op: "suspects", want: []string{"n1/3001/1000/new"}},
		}},
		{"stale beat does not end a suspicion", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 0, op: "beat", name: "n1", seq: 5, sent: 0},
			{ms: 3001, op: "suspects", want: []string{"n1/3001/0/"}},
			{ms: 3500, op: "beat", name: "n1", seq: 5, sent: 0},
			{ms: 9000, op: "suspects"},
		}},
		{"restarted sender: lower seq sent later", []step{
			{ms: 0, op: "watch", name: "n1"},
			{ms: 0, op: "beat", name: "n1", seq: 900, sent: 0},
			{ms: 2000, op: "beat", name: "n1", seq: 1, sent: 2000, jobs: []string{"after-restart"}},
			{ms: 5001, op: "suspects", want: []string{"n1/3001/2000/after-restart"}},
		}},
		{"beat without sender ignored", []step{
			{ms: 0, op: "watch", name: ""},
			{ms: 2000, op: "beat", name: "", seq: 1, sent: 2000},
			{ms: 3001, op: "suspects", want: []string{"/3001/-1/"}},
		}},
		{"clock before watch start", []step{
			{ms: 5000, op: "watch", name: "n1"},
			{ms: 0, op: "suspects"},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := NewWatchdog(cfg)
			for i, s := range tc.steps {
				now := at(s.ms)
				switch s.op {
				case "watch":
					w.Watch(s.name, now)
				case "unwatch":
					w.Unwatch(s.name)
				case "clear":
					w.Clear(s.name, now)
				case "beat":
					w.Beat(Beat{From: s.name, Seq: s.seq, Busy: s.busy, Jobs: s.jobs, Sent: at(s.sent)}, now)
				case "suspects":
					var got []string
					for _, x := range w.Suspects(now) {
						if !x.Since.Equal(now.Add(-x.Silence)) {
							t.Fatalf("step %d: suspect %s silent %s since %s, not since now - silence", i, x.Name, x.Silence, x.Since.Sub(t0))
						}
						last := -1
						if !x.LastBeat.IsZero() {
							last = int(x.LastBeat.Sub(t0) / time.Millisecond)
						}
						g := fmt.Sprintf("%s/%d/%d/%s", x.Name, x.Silence/time.Millisecond, last, strings.Join(x.Jobs, ","))
						if x.Busy != "" {
							g += " " + x.Busy
						}
						if x.InGrace {
							g += " in grace"
						}
						got = append(got, g)
					}
					if !slices.Equal(got, s.want) {
						t.Fatalf("step %d (t=%dms): suspects %q, want %q", i, s.ms, got, s.want)
					}
				default:
					t.Fatalf("bad op %q", s.op)
				}
			}
		})
	}
}

func TestLast(t *testing.T) {
	w := NewWatchdog(Config{Timeout: time.Second})
	if _, _, ok := w.Last("n1"); ok {
		t.Fatal("Last of a member never heard")
	}
	jobs := []string{"j1"}
	w.Beat(Beat{From: "n1", Seq: 7, Busy: BusyRestore, Jobs: jobs, Sent: at(10)}, at(20)) // not watched: kept
	jobs[0] = "changed"
	b, arrived, ok := w.Last("n1")
	if !ok || b.Seq != 7 || b.Busy != BusyRestore || !b.Sent.Equal(at(10)) || !arrived.Equal(at(20)) || !slices.Equal(b.Jobs, []string{"j1"}) {
		t.Fatalf("Last = %+v %v %v", b, arrived, ok)
	}
	b.Jobs[0] = "mutated"
	if b2, _, _ := w.Last("n1"); b2.Jobs[0] != "j1" {
		t.Fatal("Last returned the watchdog's own slice")
	}
	w.Unwatch("n1")
	if _, _, ok := w.Last("n1"); !ok {
		t.Fatal("Unwatch dropped the last beat")
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg Config
		err string
	}{
		{Config{Timeout: time.Second}, ""},
		{Config{Timeout: time.Second, BusyGrace: time.Minute}, ""},
		{Config{}, "timeout 0s must be positive"},
		{Config{Timeout: -time.Second}, "must be positive"},
		{Config{Timeout: time.Second, BusyGrace: -1}, "must not be negative"},
		{Config{Timeout: time.Second, MaxCheckGap: -1}, "max check gap -1ns must not be negative"},
	} {
		err := tc.cfg.Validate()
		if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("Validate(%+v) = %v, want %q", tc.cfg, err, tc.err)
		}
	}
}

func TestConcurrentUse(t *testing.T) {
	w := NewWatchdog(Config{Timeout: time.Second})
	var wg sync.WaitGroup
	for g := range 4 {
		name := fmt.Sprintf("n%d", g)
		wg.Go(func() {
			for i := range 200 {
				now := at(i * 10)
				w.Watch(name, now)
				w.Beat(Beat{From: name, Seq: uint64(i + 1), Sent: now}, now)
				w.Suspects(now)
				w.Last(name)
				w.Clear(name, now)
			}
		})
	}
	wg.Wait()
	for g := range 4 {
		if b, _, ok := w.Last(fmt.Sprintf("n%d", g)); !ok || b.Seq != 200 {
			t.Errorf("n%d: last beat %+v %v, want seq 200", g, b, ok)
		}
	}
}

// TestLateWatchdog: a watchdog that was itself not scheduled (its checks came further apart than
// MaxCheckGap) does not take the silence it measured for evidence, for one more gap; checks on time
// suspect as before.
func TestLateWatchdog(t *testing.T) {
	cfg := Config{Timeout: 200 * time.Millisecond, MaxCheckGap: 100 * time.Millisecond}
	for _, tc := range []struct {
		name   string
		beats  []int // arrival times, ms
		checks []int // calls of Suspects, ms
		want   []int // the checks (ms) that report n1
		late   uint64
	}{
		{"on time: suspected after the timeout", []int{0}, []int{25, 50, 100, 150, 200, 225, 250}, []int{225}, 0},
		{"stalled past the timeout: not suspected at the late check", []int{0}, []int{25, 50, 600}, nil, 1},
		{"stalled: suspected once on time for a gap again", []int{0}, []int{25, 50, 600, 650, 701}, []int{701}, 1},
		{"stalled: beats read after the stall clear it", []int{0, 610}, []int{25, 50, 600, 650, 701, 800}, nil, 1},
		{"a gap of exactly MaxCheckGap is on time", []int{0}, []int{100, 200, 300}, []int{300}, 0},
		{"every check late: never suspects", []int{0}, []int{10, 300, 600, 900}, nil, 3},
		{"first check is never late", []int{0}, []int{500}, []int{500}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := NewWatchdog(cfg)
			w.Watch("n1", at(0))
			var got []int
			bi := 0
			for _, c := range tc.checks {
				for bi < len(tc.beats) && tc.beats[bi] <= c {
					w.Beat(Beat{From: "n1", Seq: uint64(bi + 1), Sent: at(tc.beats[bi])}, at(tc.beats[bi]))
					bi++
				}
				if s := w.Suspects(at(c)); len(s) > 0 {
					got = append(got, c)
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("suspected at %v ms, want %v", got, tc.want)
			}
			if w.LateChecks() != tc.late {
				t.Errorf("LateChecks %d, want %d", w.LateChecks(), tc.late)
			}
		})
	}
}

// TestCheckedAfterConfirmation: the time a caller spends confirming a suspicion (Checked) is not a late
// check; the same gap without it is.
func TestCheckedAfterConfirmation(t *testing.T) {
	for _, tc := range []struct {
		name    string
		checked bool
		late    uint64
	}{
		{"confirmation reported", true, 0},
		{"confirmation not reported", false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := NewWatchdog(Config{Timeout: 200 * time.Millisecond, MaxCheckGap: 100 * time.Millisecond})
			w.Watch("n1", at(0))
			for _, c := range []int{50, 100, 150, 201} { // n1 suspected at 201
				w.Suspects(at(c))
			}
			if tc.checked {
				w.Checked(at(400)) // confirmed alive at 400
			}
			w.Suspects(at(450))
			if w.LateChecks() != tc.late {
				t.Errorf("LateChecks %d, want %d", w.LateChecks(), tc.late)
			}
		})
	}
}

// TestHeardSince: only a beat that arrived after the given time counts (the confirmation's last check).
func TestHeardSince(t *testing.T) {
	w := NewWatchdog(Config{Timeout: time.Second})
	w.Beat(Beat{From: "n1", Seq: 1, Sent: at(0)}, at(100))
	for _, tc := range []struct {
		name string
		who  string
		t    int
		want bool
	}{
		{"beat after t", "n1", 50, true},
		{"beat at t", "n1", 100, false},
		{"beat before t", "n1", 150, false},
		{"never heard", "n2", 0, false},
	} {
		if got := w.HeardSince(tc.who, at(tc.t)); got != tc.want {
			t.Errorf("%s: HeardSince(%s, %d) = %v, want %v", tc.name, tc.who, tc.t, got, tc.want)
		}
	}
}

// A suspect carries its last beat's word on which of its jobs' replicas lack connections (what the
// recovery must not restore from), as a copy of its own.
func TestSuspectUncovered(t *testing.T) {
	w := NewWatchdog(Config{Timeout: time.Second})
	w.Watch("n1", at(0))
	un := []Uncovered{{Job: "j1", Replica: "s2"}}
	w.Beat(Beat{From: "n1", Seq: 1, Sent: at(0), Jobs: []string{"j1", "j2"}, Uncovered: un}, at(0))
	un[0].Replica = "changed by the caller"
	want := []Uncovered{{Job: "j1", Replica: "s2"}}
	if b, _, _ := w.Last("n1"); !slices.Equal(b.Uncovered, want) {
		t.Errorf("last beat %+v", b)
	}
	got := w.Suspects(at(1001))
	if len(got) != 1 || !slices.Equal(got[0].Uncovered, want) {
		t.Fatalf("suspects %+v", got)
	}
}

// TestDue: when a call of Suspects could first suspect someone, so that a caller checking on a grid shared
// with the beats' can check just after it (a check at that very instant finds the silence a hair short).
func TestDue(t *testing.T) {
	cfg := Config{Timeout: 300 * time.Millisecond, BusyGrace: time.Second, MaxCheckGap: 100 * time.Millisecond}
	type ev struct {
		ms   int
		op   string // watch, beat, busy-beat, suspects
		name string
	}
	for _, tc := range []struct {
		name string
		evs  []ev
		want int // ms; -1: none
	}{
		{"nobody watched", []ev{{0, "beat", "n1"}}, -1},
		{"watched, never heard: from the watch", []ev{{50, "watch", "n1"}}, 350},
		{"from the last beat's arrival", []ev{{0, "watch", "n1"}, {75, "beat", "n1"}, {150, "beat", "n1"}}, 450},
		{"a busy beat is due at the timeout too", []ev{{0, "watch", "n1"}, {75, "busy-beat", "n1"}}, 375},
		{"the earliest of two", []ev{{0, "watch", "n1"}, {0, "watch", "n2"}, {100, "beat", "n1"}}, 300},
		{"a suspect is not due again", []ev{{0, "watch", "n1"}, {301, "suspects", ""}}, -1},
		{"after a late check, not before the watchdog resumes", []ev{{0, "watch", "n1"}, {10, "suspects", ""}, {500, "suspects", ""}, {560, "suspects", ""}}, 600},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := NewWatchdog(cfg)
			seq := uint64(0)
			for _, e := range tc.evs {
				switch e.op {
				case "watch":
					w.Watch(e.name, at(e.ms))
				case "beat", "busy-beat":
					seq++
					b := Beat{From: e.name, Seq: seq, Sent: at(e.ms)}
					if e.op == "busy-beat" {
						b.Busy = "checkpointing"
					}
					w.Beat(b, at(e.ms))
				case "suspects":
					w.Suspects(at(e.ms))
				}
			}
			due, ok := w.Due()
			if tc.want < 0 {
				if ok {
					t.Fatalf("due at %v, want none", due.Sub(t0))
				}
				return
			}
			if !ok || !due.Equal(at(tc.want)) {
				t.Fatalf("due at %v (%v), want %d ms", due.Sub(t0), ok, tc.want)
			}
			if s := w.Suspects(due.Add(time.Millisecond)); len(s) == 0 {
				t.Errorf("nobody suspected 1 ms after the due time")
			}
		})
	}
}

// TestBeatGap: a recorded beat that continues its sender's sequence reports the gap since the previous
// one on both clocks, and which side spent it; a first beat, a duplicate and a restarted sender do not.
func TestBeatGap(t *testing.T) {
	type b struct{ seq, sent, arrived int }
	for _, tc := range []struct {
		name   string
		beats  []b
		ok     bool
		gap    Gap
		sender bool
	}{
		{"first beat", []b{{1, 0, 5}}, false, Gap{}, false},
		{"on time", []b{{1, 0, 5}, {2, 75, 80}}, true, Gap{Arrived: 75 * time.Millisecond, Sent: 75 * time.Millisecond}, true},
		{"sent late", []b{{1, 0, 5}, {2, 300, 305}}, true, Gap{Arrived: 300 * time.Millisecond, Sent: 300 * time.Millisecond}, true},
		{"delivered late", []b{{1, 0, 5}, {2, 75, 310}}, true, Gap{Arrived: 305 * time.Millisecond, Sent: 75 * time.Millisecond}, false},
		{"beats lost between", []b{{1, 0, 5}, {4, 225, 230}}, true, Gap{Arrived: 225 * time.Millisecond, Sent: 225 * time.Millisecond, Missing: 2}, true},
		{"duplicate", []b{{1, 0, 5}, {1, 0, 90}}, false, Gap{}, false},
		{"restarted sender", []b{{7, 0, 5}, {1, 400, 405}}, false, Gap{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := NewWatchdog(Config{Timeout: time.Second})
			var gap Gap
			var ok bool
			for _, x := range tc.beats {
				gap, ok = w.Beat(Beat{From: "n1", Seq: uint64(x.seq), Sent: at(x.sent)}, at(x.arrived))
			}
			if ok != tc.ok || gap != tc.gap {
				t.Fatalf("gap %+v ok %v, want %+v %v", gap, ok, tc.gap, tc.ok)
			}
			if ok && gap.Sender() != tc.sender {
				t.Errorf("Sender() %v, want %v", gap.Sender(), tc.sender)
			}
		})
	}
}

// TestRestartedSenderWithClockBehind: a sender that restarted (a new Run, its Seq from 1 again) with its
// clock behind its previous run's (a reboot before NTP stepped it) is heard. Before, all its beats were
// dropped as duplicates until its Seq passed the old run's (a day of beats at 500 ms), and it was suspected
// after every timeout, its busy grace and job list ignored.
func TestRestartedSenderWithClockBehind(t *testing.T) {
	w := NewWatchdog(Config{Timeout: 3 * time.Second, BusyGrace: 10 * time.Second})
	w.Watch("n1", at(0))
	w.Beat(Beat{From: "n1", Run: 7, Seq: 172800, Sent: at(0), Jobs: []string{"old"}}, at(0))
	var suspected []Suspect
	for i := 1; i <= 20; i++ {
		now := at(500 * i)
		w.Beat(Beat{From: "n1", Run: 9, Seq: uint64(i), Sent: now.Add(-10 * time.Second), Busy: BusyCheckpoint, Jobs: []string{"new"}}, now)
		suspected = append(suspected, w.Suspects(now)...)
	}
	if len(suspected) > 0 {
		t.Errorf("n1 beat every 500 ms for 10 s but was suspected: %+v", suspected)
	}
	if b, _, _ := w.Last("n1"); b.Seq != 20 || !slices.Equal(b.Jobs, []string{"new"}) {
		t.Errorf("last beat recorded: %+v, want the new run's 20th", b)
	}
	// Within one run, a beat of a lower Seq sent no later is still a duplicate.
	if _, ok := w.Beat(Beat{From: "n1", Run: 9, Seq: 3, Sent: at(0)}, at(10_500)); ok {
		t.Error("a duplicate of the same run counted as a new beat")
	}
	if b, _, _ := w.Last("n1"); b.Seq != 20 {
		t.Errorf("a duplicate replaced the last beat: %+v", b)
	}
}

// TestBeatEndsAClearAhead: a protector whose fail-over of a silent member changed nothing clears its
// suspicion with a time ahead of now (the agent's retry wait, up to 10 minutes), so that it is not failed
// over again at every timeout. A member that beats again meanwhile is not silent: once it stops again, it
// is suspected a timeout after its last beat. Before, the silence still counted from the time ahead, and a
// member back from a flap that then crashed was declared only once that wait had run out.
func TestBeatEndsAClearAhead(t *testing.T) {
	w := NewWatchdog(Config{Timeout: 3 * time.Second})
	w.Watch("n1", at(0))
	if got := w.Suspects(at(3001)); len(got) != 1 {
		t.Fatalf("suspects at 3001: %+v, want n1", got)
	}
	w.Clear("n1", at(3001).Add(10*time.Minute-3*time.Second)) // the retry wait after a fail-over that changed nothing
	if got := w.Suspects(at(10_000)); len(got) != 0 {
		t.Fatalf("suspects within the retry wait: %+v, want none", got)
	}
	w.Beat(Beat{From: "n1", Seq: 1, Sent: at(20_000)}, at(20_000)) // back, then silent again (crashed)
	if got := w.Suspects(at(23_000)); len(got) != 0 {
		t.Fatalf("suspects a timeout after its beat, not past it: %+v", got)
	}
	got := w.Suspects(at(23_001))
	if len(got) != 1 || got[0].Name != "n1" || got[0].Silence != 3001*time.Millisecond {
		t.Fatalf("suspects just past a timeout after its last beat: %+v, want n1 silent 3001ms", got)
	}
	if due, ok := w.Due(); ok {
		t.Errorf("Due %s after the only member was suspected", due.Sub(t0))
	}
}

// TestStaleBeatOfSameRunAfterClockStep: within one run a sender's Seq only grows, so a lower Seq of that
// run is a beat that came late (buffered on a stream the sender had replaced), whatever its Sent says: the
// sender's wall clock may have been stepped back between the two (NTP). Before, such a beat was taken for a
// restart and replaced the newer one: its older job list would be what a fail-over restores.
func TestStaleBeatOfSameRunAfterClockStep(t *testing.T) {
	w := NewWatchdog(Config{Timeout: 3 * time.Second})
	w.Watch("n1", at(0))
	w.Beat(Beat{From: "n1", Run: 9, Seq: 5, Sent: at(10_000), Jobs: []string{"a"}}, at(500))
	// The clock stepped back 10 s; the new beat names a job started since.
	w.Beat(Beat{From: "n1", Run: 9, Seq: 6, Sent: at(1_000), Jobs: []string{"a", "b"}}, at(1_000))
	if _, ok := w.Beat(Beat{From: "n1", Run: 9, Seq: 5, Sent: at(10_000), Jobs: []string{"a"}}, at(1_100)); ok {
		t.Error("a stale beat of the same run counted as continuing the sequence")
	}
	if b, _, _ := w.Last("n1"); b.Seq != 6 || !slices.Equal(b.Jobs, []string{"a", "b"}) {
		t.Errorf("last beat recorded: %+v, want seq 6 naming a and b", b)
	}
	// An agent that sends no Run (an older one) is still heard after a restart whose clock went on.
	w.Beat(Beat{From: "n2", Seq: 7, Sent: at(0)}, at(0))
	w.Beat(Beat{From: "n2", Seq: 1, Sent: at(400)}, at(400))
	if b, _, _ := w.Last("n2"); b.Seq != 1 {
		t.Errorf("an older agent's restart was not recorded: %+v", b)
	}
}

// The count of jobs a receiver left out of a beat reaches the suspicion, for the fail-over to report them
// rather than leave them unrestored unsaid.
func TestSuspectUnlisted(t *testing.T) {
	w := NewWatchdog(Config{Timeout: time.Second})
	w.Watch("n1", at(0))
	w.Beat(Beat{From: "n1", Seq: 1, Jobs: []string{"j1"}, Unlisted: 3, Sent: at(10)}, at(10))
	s := w.Suspects(at(2000))
	if len(s) != 1 || s[0].Unlisted != 3 || !slices.Equal(s[0].Jobs, []string{"j1"}) {
		t.Fatalf("Suspects = %+v, want n1 with jobs [j1] and 3 not listed", s)
	}
}
