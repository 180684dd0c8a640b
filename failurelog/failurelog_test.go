package failurelog

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/tcpflow"
)

func TestMergeKeepsNewest(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(dir, "node1")
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	l.Update("n2-1", func(f *Failure) {
		f.Node, f.Protector, f.Detected = "node2", "node3", t0
		f.Stages = append(f.Stages, Stage{Name: "detected", Start: t0.Add(-time.Second), End: t0})
	})
	older := &Failure{ID: "n2-1", Node: "node2", Protector: "node3", Detected: t0, Updated: t0.Add(-time.Hour)}
	newer := &Failure{ID: "n2-1", Node: "node2", Protector: "node3", Detected: t0, Updated: time.Now().Add(time.Hour), Done: true,
		Stages: []Stage{{Name: "detected"}, {Name: "restored"}}}
	other := &Failure{ID: "n4-1", Node: "node4", Protector: "node3", Detected: t0.Add(time.Minute), Updated: t0}
	tests := []struct {
		name       string
		in         *Failure
		wantStages int
		wantDone   bool
	}{
		{"an older copy does not replace ours", older, 1, false},
		{"a newer copy does", newer, 2, true},
		{"nil is ignored", nil, 2, true},
	}
	for _, tt := range tests {
		l.Merge("node3", tt.in)
		got := l.List()[0]
		if len(got.Stages) != tt.wantStages || got.Done != tt.wantDone {
			t.Errorf("%s: %d stages, done %v; want %d, %v", tt.name, len(got.Stages), got.Done, tt.wantStages, tt.wantDone)
		}
	}
	l.Merge("node3", other)
	// A copy handed out is not the stored one.
	l.List()[0].Stages[0].Name = "changed"
	if err := l.Save(); err != nil {
		t.Fatal(err)
	}
	back, err := Open(dir, "node1")
	if err != nil {
		t.Fatal(err)
	}
	got := back.List()
	if len(got) != 2 || got[0].ID != "n2-1" || got[1].ID != "n4-1" || got[0].Stages[0].Name != "detected" {
		t.Fatalf("after reload: %+v", got)
	}
}

func TestBound(t *testing.T) {
	t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	stages := func(n int) []Stage {
		var out []Stage
		for i := range n {
			out = append(out, Stage{Name: fmt.Sprintf("stage %d", i), Start: t0, End: t0.Add(time.Duration(i) * time.Millisecond)})
		}
		return out
	}
	long := strings.Repeat("<", 5000) // JSON writes each as \u003c: the worst case for the message size
	mismatch := &recvdigest.MismatchError{Conn: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.233.122.12:38582"), Remote: netip.MustParseAddrPort("10.233.122.11:7601")},
		From: 2789081088, To: 2789146624, Got: 0x6973818b, Want: 0x8c3d5983}
	recoveryErr := fmt.Errorf("recovery on spare1: job nondet1-89244a5f is not transparently recoverable (killed): %w", mismatch).Error()
	tests := []struct {
		name        string
		in          Failure
		wantStages  []string // names of the stages kept
		wantDropped int
		check       func(t *testing.T, f Failure)
	}{
		{name: "a small failure is left alone", in: Failure{ID: "x", Stages: stages(3), Jobs: []string{"a", "b"}, Error: "e"},
			wantStages: []string{"stage 0", "stage 1", "stage 2"},
			check: func(t *testing.T, f Failure) {
				if len(f.Jobs) != 2 || f.Error != "e" {
					t.Errorf("changed: %+v", f)
				}
			}},
		{name: "exactly the stage bound", in: Failure{ID: "x", Stages: stages(32)}, wantStages: names(stages(32))},
		{name: "many stages: the first and the newest are kept", in: Failure{ID: "x", Stages: stages(100)},
			wantStages: append([]string{"stage 0"}, names(stages(100)[69:])...), wantDropped: 68},
		{name: "dropped stages add up", in: Failure{ID: "x", Stages: stages(33), StagesDropped: 10},
			wantStages: append([]string{"stage 0"}, names(stages(33)[2:])...), wantDropped: 11},
		{name: "long texts are cut", in: Failure{ID: "x", Error: long, Node: long,
			Stages: []Stage{{Name: long, Job: long, Host: long, Detail: long, Error: long}}, Jobs: []string{long}},
			wantStages: []string{strings.Repeat("<", 125) + "..."},
			check: func(t *testing.T, f Failure) {
				s := f.Stages[0]
				for what, got := range map[string]int{"error": len(f.Error), "stage detail": len(s.Detail), "stage error": len(s.Error)} {
					if got != 1024 {
						t.Errorf("%s: %d bytes, want 1024", what, got)
					}
				}
				for what, got := range map[string]int{"node": len(f.Node), "job": len(f.Jobs[0]), "stage job": len(s.Job), "stage host": len(s.Host)} {
					if got != 128 {
						t.Errorf("%s: %d bytes, want 128", what, got)
					}
				}
			}},
		{name: "a cut never splits a character", in: Failure{ID: "x", Error: strings.Repeat("é", 1000)},
			check: func(t *testing.T, f Failure) {
				if !utf8.ValidString(f.Error) || len(f.Error) > 1024 || !strings.HasSuffix(f.Error, "...") {
					t.Errorf("cut error: %d bytes, valid %v", len(f.Error), utf8.ValidString(f.Error))
				}
			}},
		// What `ftctl events` and the tests read in a failed replay must survive: the whole error of a
		// recovery, wrapped as the recovery wraps it.
		{name: "a recovery error is kept whole", in: Failure{ID: "x", Error: recoveryErr, Stages: []Stage{{Name: "replay done", Error: recoveryErr}}},
			wantStages: []string{"replay done"},
			check: func(t *testing.T, f Failure) {
				if f.Error != recoveryErr || f.Stages[0].Error != recoveryErr {
					t.Errorf("cut: %q", f.Stages[0].Error)
				}
			}},
		{name: "too many jobs", in: Failure{ID: "x", Jobs: make([]string, 1000)},
			check: func(t *testing.T, f Failure) {
				if len(f.Jobs) != 256 {
					t.Errorf("%d jobs kept, want 256", len(f.Jobs))
				}
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := tt.in
			f.bound()
			if tt.wantStages != nil && !slices.Equal(names(f.Stages), tt.wantStages) {
				t.Errorf("stages %v, want %v", names(f.Stages), tt.wantStages)
			}
			if f.StagesDropped != tt.wantDropped {
				t.Errorf("StagesDropped %d, want %d", f.StagesDropped, tt.wantDropped)
			}
			if tt.check != nil {
				tt.check(t, f)
			}
		})
	}
}

func names(ss []Stage) []string {
	var out []string
	for _, s := range ss {
		out = append(out, s.Name)
	}
	return out
}

// TestKeepsNewest: the log keeps the 100 most recent failures, whether they are recorded here
// or merged from another node, and a reloaded log keeps the same.
func TestKeepsNewest(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(dir, "node1")
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	at := func(i int) time.Time { return t0.Add(time.Duration(i) * time.Minute) }
	for i := range 150 {
		l.Update(fmt.Sprintf("f%03d", i), func(f *Failure) { f.Node, f.Protector, f.Detected = "node2", "node3", at(i) })
	}
	steps := []struct {
		name        string
		merge       *Failure
		wantFirst   string // the oldest failure kept
		wantLast    string
		wantPresent bool // whether the merged failure is in the log after the step
	}{
		{"recorded here", nil, "f050", "f149", false},
		{"a peer's older failure does not displace a newer one", &Failure{ID: "old", Protector: "node3", Detected: at(-5), Updated: time.Now()}, "f050", "f149", false},
		{"a peer's newer failure displaces the oldest", &Failure{ID: "new", Protector: "node3", Detected: at(500), Updated: time.Now()}, "f051", "new", true},
		{"a peer's failure with an overlong id is refused", &Failure{ID: strings.Repeat("x", 200), Protector: "node3", Detected: at(600), Updated: time.Now()}, "f051", "new", false},
	}
	for _, st := range steps {
		if st.merge != nil {
			l.Merge("node3", st.merge)
		}
		got := l.List()
		if len(got) != 100 || got[0].ID != st.wantFirst || got[len(got)-1].ID != st.wantLast {
			t.Errorf("%s: %d failures, %s .. %s; want 100, %s .. %s", st.name, len(got), got[0].ID, got[len(got)-1].ID, st.wantFirst, st.wantLast)
		}
		if st.merge != nil && slices.ContainsFunc(got, func(f *Failure) bool { return f.ID == st.merge.ID }) != st.wantPresent {
			t.Errorf("%s: merged failure present %v, want %v", st.name, !st.wantPresent, st.wantPresent)
		}
	}
	if err := l.Save(); err != nil {
		t.Fatal(err)
	}
	back, err := Open(dir, "node1")
	if err != nil {
		t.Fatal(err)
	}
	if got := back.List(); len(got) != 100 || got[0].ID != "f051" {
		t.Fatalf("after reload: %d failures from %s", len(got), got[0].ID)
	}
}

// A spare that fails while it restores a failed node's jobs: its own failure's recovery takes them over.

func TestTakeOver(t *testing.T) {
	l, err := Open(t.TempDir(), "node3")
	if err != nil {
		t.Fatal(err)
	}
	add := func(f Failure) { l.Update(f.ID, func(g *Failure) { *g = f }) }
	add(Failure{ID: "node2-1", Node: "node2", Protector: "node3", Target: "spare1", Jobs: []string{"a", "b"}})
	add(Failure{ID: "node4-1", Node: "node4", Protector: "node3", Target: "spare1", Jobs: []string{"c"}, Done: true})        // over
	add(Failure{ID: "node5-1", Node: "node5", Protector: "node1", Target: "spare1", Jobs: []string{"d"}})                    // not ours
	add(Failure{ID: "node6-1", Node: "node6", Protector: "node3", Target: "spare2", Jobs: []string{"e"}})                    // elsewhere
	add(Failure{ID: "node7-1", Node: "node7", Protector: "node3", Target: "spare1", Jobs: []string{"f"}, Kind: "migration"}) // a move

	got := l.TakeOver("node3", "spare1", "spare1-1")
	if want := map[string]string{"a": "node2", "b": "node2"}; !maps.Equal(got, want) {
		t.Fatalf("taken %v, want %v", got, want)
	}
	for _, f := range l.List() {
		want := ""
		if f.ID == "node2-1" {
			want = "spare1-1"
		}
		if f.TakenOver != want {
			t.Errorf("failure %s taken over by %q, want %q", f.ID, f.TakenOver, want)
		}
	}
	if again := l.TakeOver("node3", "spare1", "spare1-2"); len(again) != 0 {
		t.Errorf("taken over twice: %v", again)
	}
}

// TestOpenRefusesALink: the log's file is read without following a link, as the agent's other state files
// are; an operator is told to move it away.
func TestOpenRefusesALink(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(t.TempDir(), "elsewhere.json")
	if err := os.WriteFile(target, []byte("[]"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(dir, "failures.json")); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(dir, "node1"); err == nil || !strings.Contains(err.Error(), "move it away") {
		t.Fatalf("Open over a link: %v, want a refusal that says what to do", err)
	}
}

// TestMergeOnlyFromProtector: a member's copy of a timeline is merged only if the member coordinates it,
// and only over a timeline of the same protector: no member replaces another's timeline (with a stamp
// far ahead, which would win every merge) or this agent's own, nor makes one up in another's name.
func TestMergeOnlyFromProtector(t *testing.T) {
	l, t0 := ownRecovery(t)
	// node3's recovery of node4, as node3 sent it.
	if !l.Merge("node3", &Failure{ID: "node4-1", Node: "node4", Protector: "node3", Target: "spare2", Detected: t0, Updated: t0}) {
		t.Fatal("the protector's own timeline was not merged")
	}
	future := t0.Add(24 * 365 * time.Hour)
	for _, tc := range []struct {
		name string
		peer string
		f    *Failure
	}{
		{"ours, marked done by another member", "node3",
			&Failure{ID: "node2-1", Node: "node2", Protector: "node1", Target: "spare1", Done: true, Updated: future}},
		{"ours, claimed by another member", "node3",
			&Failure{ID: "node2-1", Node: "node2", Protector: "node3", Target: "spare1", Done: true, Updated: future}},
		{"made up in our name", "node3",
			&Failure{ID: "node5-1", Node: "node5", Protector: "node1", Target: "spare1", Jobs: []string{"alien"}, Updated: future}},
		{"node3's, marked done by a relay", "node4",
			&Failure{ID: "node4-1", Node: "node4", Protector: "node3", Done: true, Updated: future}},
		{"node3's, taken by another member", "node4",
			&Failure{ID: "node4-1", Node: "node4", Protector: "node4", Done: true, Updated: future}},
	} {
		if l.Merge(tc.peer, tc.f) {
			t.Errorf("%s: merged", tc.name)
		}
	}
	if got := l.TakeOver("node1", "spare1", "spare1-1"); !maps.Equal(got, map[string]string{"a": "node2"}) {
		t.Errorf("taken over %v, want job a of node2 only", got)
	}
	for _, f := range l.List() {
		if f.Done {
			t.Errorf("failure %s (protector %s) done after others' copies", f.ID, f.Protector)
		}
	}
	if !l.Merge("node3", &Failure{ID: "node4-1", Node: "node4", Protector: "node3", Done: true, Updated: t0.Add(time.Second)}) {
		t.Error("the protector's newer copy was not merged")
	}
}

// TestTrimKeepsOwn: timelines a member makes up by the hundred, dated after every real one, do not push
// this agent's own out of its log, nor another protector's.
func TestTrimKeepsOwn(t *testing.T) {
	l, t0 := ownRecovery(t)
	l.Merge("node4", &Failure{ID: "node5-1", Node: "node5", Protector: "node4", Detected: t0, Updated: t0})
	for i := range 3 * MaxFailures {
		l.Merge("node3", &Failure{ID: fmt.Sprintf("made-up-%d", i), Node: "node9", Protector: "node3",
			Detected: t0.Add(time.Duration(i+1) * time.Hour), Updated: t0})
	}
	got := l.List()
	if len(got) != MaxFailures || !slices.ContainsFunc(got, func(f *Failure) bool { return f.ID == "node2-1" }) {
		t.Fatalf("%d failures kept, this agent's own among them: %v; want %d with it", len(got),
			slices.ContainsFunc(got, func(f *Failure) bool { return f.ID == "node2-1" }), MaxFailures)
	}
	if !slices.ContainsFunc(got, func(f *Failure) bool { return f.ID == "node5-1" }) {
		t.Error("node4's timeline was pushed out by node3's")
	}
	if taken := l.TakeOver("node1", "spare1", "spare1-1"); taken["a"] != "node2" {
		t.Errorf("taken over %v, want job a", taken)
	}
}

// ownRecovery is node1's log holding its own recovery of node2 (failure node2-1: job a, under way on
// spare1, detected at t0).
func ownRecovery(t *testing.T) (l *Log, t0 time.Time) {
	t.Helper()
	l, err := Open(t.TempDir(), "node1")
	if err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	l.Update("node2-1", func(f *Failure) {
		f.Node, f.Protector, f.Target, f.Detected, f.Jobs = "node2", "node1", "spare1", t0, []string{"a"}
	})
	return l, t0
}

// TestMergeStampsReceived: a merged timeline carries when it first reached this agent, on this agent's
// clock, whatever the protector's clock says; a newer copy keeps it (the failure is no younger for being
// updated), and neither the wire nor the file carries it.
func TestMergeStampsReceived(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(dir, "node1")
	if err != nil {
		t.Fatal(err)
	}
	lagging := time.Now().Add(-time.Hour) // node3's wall clock
	before := time.Now()
	if !l.Merge("node3", &Failure{ID: "n2-1", Node: "node2", Protector: "node3", Detected: lagging, Updated: lagging, Received: lagging}) {
		t.Fatal("not merged")
	}
	first := l.List()[0].Received
	if first.Before(before) || time.Since(first) > time.Minute {
		t.Fatalf("received %v, want this host's time of the merge (after %v)", first, before)
	}
	if !l.Merge("node3", &Failure{ID: "n2-1", Node: "node2", Protector: "node3", Detected: lagging, Updated: lagging.Add(time.Second), Done: true}) {
		t.Fatal("newer copy not merged")
	}
	if got := l.List()[0]; !got.Done || !got.Received.Equal(first) {
		t.Errorf("after a newer copy: done %v, received %v; want done, received %v", got.Done, got.Received, first)
	}
	l.Update("n4-1", func(f *Failure) { f.Node, f.Protector, f.Detected = "node4", "node1", time.Now() })
	for _, f := range l.List() {
		if f.Received.IsZero() {
			t.Errorf("%s: no receipt time", f.ID)
		}
	}
	b, err := json.Marshal(l.List())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), "received") {
		t.Errorf("the receipt time goes on the wire: %s", b)
	}
	if err := l.Save(); err != nil {
		t.Fatal(err)
	}
	reopened := time.Now()
	back, err := Open(dir, "node1")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range back.List() {
		if f.Received.Before(reopened) {
			t.Errorf("%s read back from disk received at %v, before the agent started (%v)", f.ID, f.Received, reopened)
		}
	}
}

// TestNewestSendsOwnTimelines: what goes along with a view is this agent's own timelines, newest first
// within the budget, however far ahead another protector's clock dates its own: ordered among them, a
// protector's timelines dated an hour ahead filled the budget and this agent's recovery under way stayed
// home, so that the other members admitted its failed node back mid-recovery.
func TestNewestSendsOwnTimelines(t *testing.T) {
	l, err := Open(t.TempDir(), "node1")
	if err != nil {
		t.Fatal(err)
	}
	ahead := time.Now().Add(time.Hour) // node3's wall clock
	for i := range 20 {
		l.Merge("node3", &Failure{ID: fmt.Sprintf("n3-%02d", i), Node: "node4", Protector: "node3", Detected: ahead.Add(time.Duration(i) * time.Second),
			Updated: ahead, Error: strings.Repeat("e", 900)})
	}
	l.Update("node2-1", func(f *Failure) { f.Node, f.Protector, f.Detected = "node2", "node1", time.Now() })
	all := l.List()
	one, err := json.Marshal(all[len(all)-1]) // one of node3's
	if err != nil {
		t.Fatal(err)
	}
	got := l.Newest(5 * len(one)) // room for a few timelines, not all
	if len(got) != 1 || got[0].ID != "node2-1" {
		var ids []string
		for _, f := range got {
			ids = append(ids, f.ID)
		}
		t.Fatalf("sent %v; want this agent's own timeline node2-1 (only its own: the others' are not kept from it)", ids)
	}
}

// Save is called from every goroutine that changed the log (each recovery's stages, its end): the file
// must end up with the newest log, not with the older copy of a save that listed it before another's
// change and renamed its file after. An agent that stops then would read back a recovery that never
// ended, or lose its stages.
func TestConcurrentSavesKeepTheNewest(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(dir, "node1")
	if err != nil {
		t.Fatal(err)
	}
	const writers = 8
	for round := range 10 {
		start := make(chan struct{})
		done := make(chan error, writers)
		for w := range writers {
			go func() {
				<-start
				l.Update(fmt.Sprintf("node%d-%d", w+2, round), func(f *Failure) { f.Protector, f.Done = "node1", true })
				done <- l.Save()
			}()
		}
		close(start)
		for range writers {
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
		back, err := Open(dir, "node1")
		if err != nil {
			t.Fatal(err)
		}
		ids := func(fs []*Failure) []string {
			var out []string
			for _, f := range fs {
				out = append(out, f.ID)
			}
			return out
		}
		if got, want := ids(back.List()), ids(l.List()); !slices.Equal(got, want) {
			t.Fatalf("round %d: the file holds %v after every save returned, the log %v", round, got, want)
		}
	}
}

// TestUpdateStampsAfterPrevious: a protector whose clock went back (NTP stepping a clock that ran ahead)
// stamps each change of its timeline after the previous stamp anyway: a member keeps only a copy stamped
// after the one it holds, and would ignore every change, the recovery's end among them, until the clock
// caught up.
func TestUpdateStampsAfterPrevious(t *testing.T) {
	ahead := time.Now().Add(time.Hour) // the stamp written before the clock was stepped back
	for _, tc := range []struct {
		name      string
		takenOver string // the timeline's mark before the change
		change    func(l *Log)
	}{
		{"update", "", func(l *Log) { l.Update("node2-1", func(f *Failure) { f.Done = true }) }},
		{"take over", "", func(l *Log) { l.TakeOver("node1", "spare1", "spare1-1") }},
		{"give back", "spare0-1", func(l *Log) { l.GiveBack("spare0-1") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			was := []*Failure{{ID: "node2-1", Node: "node2", Protector: "node1", Target: "spare1", Detected: ahead, Updated: ahead,
				TakenOver: tc.takenOver}}
			b, err := json.Marshal(was)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "failures.json"), b, 0o600); err != nil {
				t.Fatal(err)
			}
			l, err := Open(dir, "node1")
			if err != nil {
				t.Fatal(err)
			}
			peer, err := Open(t.TempDir(), "node3")
			if err != nil {
				t.Fatal(err)
			}
			peer.Merge("node1", l.List()[0])
			tc.change(l)
			if got := l.List()[0]; !peer.Merge("node1", got) {
				t.Errorf("the peer refused the changed timeline: stamped %v, the one it holds %v", got.Updated, ahead)
			}
		})
	}
}
