package agent

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/tcpflow"
)

func TestFailureLogMergeKeepsNewest(t *testing.T) {
	dir := t.TempDir()
	l, err := openFailureLog(dir)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	l.update("n2-1", func(f *Failure) {
		f.Node, f.Detected = "node2", t0
		f.Stages = append(f.Stages, Stage{Name: StageDetected, Start: t0.Add(-time.Second), End: t0})
	})
	older := &Failure{ID: "n2-1", Node: "node2", Detected: t0, Updated: t0.Add(-time.Hour)}
	newer := &Failure{ID: "n2-1", Node: "node2", Detected: t0, Updated: time.Now().Add(time.Hour), Done: true,
		Stages: []Stage{{Name: StageDetected}, {Name: StageRestored}}}
	other := &Failure{ID: "n4-1", Node: "node4", Detected: t0.Add(time.Minute), Updated: t0}
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
		l.merge(tt.in)
		got := l.list()[0]
		if len(got.Stages) != tt.wantStages || got.Done != tt.wantDone {
			t.Errorf("%s: %d stages, done %v; want %d, %v", tt.name, len(got.Stages), got.Done, tt.wantStages, tt.wantDone)
		}
	}
	l.merge(other)
	// A copy handed out is not the stored one.
	l.list()[0].Stages[0].Name = "changed"
	if err := l.save(); err != nil {
		t.Fatal(err)
	}
	back, err := openFailureLog(dir)
	if err != nil {
		t.Fatal(err)
	}
	got := back.list()
	if len(got) != 2 || got[0].ID != "n2-1" || got[1].ID != "n4-1" || got[0].Stages[0].Name != StageDetected {
		t.Fatalf("after reload: %+v", got)
	}
}

func TestFailureBound(t *testing.T) {
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
		{name: "a recovery error is kept whole", in: Failure{ID: "x", Error: recoveryErr, Stages: []Stage{{Name: StageReplayed, Error: recoveryErr}}},
			wantStages: []string{StageReplayed},
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

// TestFailureLogKeepsNewest: the log keeps the 100 most recent failures, whether they are recorded here
// or merged from another node, and a reloaded log keeps the same.
func TestFailureLogKeepsNewest(t *testing.T) {
	dir := t.TempDir()
	l, err := openFailureLog(dir)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	at := func(i int) time.Time { return t0.Add(time.Duration(i) * time.Minute) }
	for i := range 150 {
		l.update(fmt.Sprintf("f%03d", i), func(f *Failure) { f.Node, f.Detected = "node2", at(i) })
	}
	steps := []struct {
		name        string
		merge       *Failure
		wantFirst   string // the oldest failure kept
		wantLast    string
		wantPresent bool // whether the merged failure is in the log after the step
	}{
		{"recorded here", nil, "f050", "f149", false},
		{"a peer's older failure does not displace a newer one", &Failure{ID: "old", Detected: at(-5), Updated: time.Now()}, "f050", "f149", false},
		{"a peer's newer failure displaces the oldest", &Failure{ID: "new", Detected: at(500), Updated: time.Now()}, "f051", "new", true},
		{"a peer's failure with an overlong id is refused", &Failure{ID: strings.Repeat("x", 200), Detected: at(600), Updated: time.Now()}, "f051", "new", false},
	}
	for _, st := range steps {
		if st.merge != nil {
			l.merge(st.merge)
		}
		got := l.list()
		if len(got) != 100 || got[0].ID != st.wantFirst || got[len(got)-1].ID != st.wantLast {
			t.Errorf("%s: %d failures, %s .. %s; want 100, %s .. %s", st.name, len(got), got[0].ID, got[len(got)-1].ID, st.wantFirst, st.wantLast)
		}
		if st.merge != nil && slices.ContainsFunc(got, func(f *Failure) bool { return f.ID == st.merge.ID }) != st.wantPresent {
			t.Errorf("%s: merged failure present %v, want %v", st.name, !st.wantPresent, st.wantPresent)
		}
	}
	if err := l.save(); err != nil {
		t.Fatal(err)
	}
	back, err := openFailureLog(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := back.list(); len(got) != 100 || got[0].ID != "f051" {
		t.Fatalf("after reload: %d failures from %s", len(got), got[0].ID)
	}
}

// TestViewMessageFitsWithManyFailures: however many failures with however many stages the log was given,
// the view message an agent sends fits the body a peer reads (at most maxMessage bytes), and it
// carries the newest failures: all that the log keeps when they look like real recoveries, fewer when
// every text is as long, and as expensive to encode, as can be.
func TestViewMessageFitsWithManyFailures(t *testing.T) {
	tests := []struct {
		name         string
		failures     int
		stages, jobs int
		text         string
		ident        string // names of jobs and hosts
		wantAll      bool   // every failure the log keeps (100) is in the message
	}{
		// Five stages per job, two jobs, short details: what recoveries write.
		{"realistic recoveries", 300, 12, 2, "restored 1 job(s) from snapshot 20261122T100000.000-0001 in 812 ms", "rank1-0123abcd", true},
		// "<&>" is escaped by encoding/json to six bytes a character; every name and text is longer than
		// the log keeps: a single failure must still fit.
		{"every text as long as can be", 300, 60, 400, strings.Repeat("<&>", 700), strings.Repeat("<", 200), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := openFailureLog(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
			for i := range tt.failures {
				id := fmt.Sprintf("node2-%04d", i)
				l.update(id, func(f *Failure) {
					f.Node, f.Detected, f.Error = "node2", t0.Add(time.Duration(i)*time.Second), tt.text
					for j := range tt.jobs {
						f.Jobs = append(f.Jobs, fmt.Sprintf("%d-%s", j, tt.ident))
					}
				})
				for range tt.stages {
					l.update(id, func(f *Failure) {
						f.Stages = append(f.Stages, Stage{Name: StageRestored, Job: tt.ident, Host: tt.ident,
							Start: t0, End: t0.Add(time.Second), Detail: tt.text, Error: tt.text})
					})
				}
			}
			var ms []ring.Member
			for i := range 3 {
				ms = append(ms, ring.Member{Name: fmt.Sprintf("node%d", i+1), Role: ring.RoleNode, State: ring.StateAlive,
					Address: netip.MustParseAddrPort(fmt.Sprintf("10.0.0.%d:7946", i+1))})
			}
			v, err := ring.New(ms)
			if err != nil {
				t.Fatal(err)
			}
			a := &Agent{failures: l}
			a.members.view = v
			// The message as the protocol carries it: a body of at most maxMessage bytes.
			b, err := json.Marshal(a.viewMessage())
			if err != nil {
				t.Fatal(err)
			}
			size := len(b)
			if size > maxMessage {
				t.Fatalf("a view message of %d bytes, more than the %d a peer reads", size, maxMessage)
			}
			var msg viewMessage
			if err := json.Unmarshal(b, &msg); err != nil {
				t.Fatal(err)
			}
			var got struct{ Failures []*Failure }
			if got.Failures, err = decodeFailures(msg.Failures); err != nil {
				t.Fatalf("a view message of %d bytes cannot be read back: %v", size, err)
			}
			newest := fmt.Sprintf("node2-%04d", tt.failures-1)
			if len(got.Failures) == 0 || got.Failures[len(got.Failures)-1].ID != newest {
				t.Fatalf("view message (%d bytes) carries %d failures; want the newest, %s", size, len(got.Failures), newest)
			}
			if tt.wantAll && len(got.Failures) != 100 {
				t.Errorf("view message (%d bytes) carries %d failures, want all 100 the log keeps", size, len(got.Failures))
			}
			t.Logf("view message: %d bytes, %d failures", size, len(got.Failures))
		})
	}
}
