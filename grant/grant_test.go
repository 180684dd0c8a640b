package grant

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 3, 1, 12, 3, 4, 0, time.UTC)

func open(t *testing.T, path string, opts Options) *Registry {
	t.Helper()
	r, err := Open(path, opts)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func req(job string, n uint64, holder, host string) Request {
	return Request{Job: job, Incarnation: n, Holder: holder, Host: host}
}

func TestGrant(t *testing.T) {
	type step struct {
		q       Request
		release bool   // Release(q) instead of Grant(q)
		want    string // "granted", "conflict" (refused by an earlier grant), "invalid"
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"first grant", []step{{q: req("j", 1, "restore:a", "spare1"), want: "granted"}}},
		{"same holder again is idempotent", []step{
			{q: req("j", 1, "restore:a", "spare1"), want: "granted"},
			{q: req("j", 1, "restore:a", "spare1"), want: "granted"},
		}},
		{"competing holder refused", []step{
			{q: req("j", 1, "restore:a", "spare1"), want: "granted"},
			{q: req("j", 1, "failover:node1-x", "spare1"), want: "conflict"},
		}},
		{"same holder name from another host refused", []step{
			{q: req("j", 1, "restore:a", "spare1"), want: "granted"},
			{q: req("j", 1, "restore:a", "node3"), want: "conflict"},
		}},
		{"older incarnation refused", []step{
			{q: req("j", 2, "restore:a", "spare1"), want: "granted"},
			{q: req("j", 1, "restore:b", "node3"), want: "conflict"},
			{q: req("j", 1, "restore:a", "spare1"), want: "conflict"}, // even to the holder of the newer one
		}},
		{"newer incarnation supersedes", []step{
			{q: req("j", 1, "restore:a", "spare1"), want: "granted"},
			{q: req("j", 2, "failover:spare1-y", "node3"), want: "granted"},
			{q: req("j", 2, "restore:a", "spare1"), want: "conflict"},
		}},
		{"released incarnation goes to the next holder", []step{
			{q: req("j", 1, "restore:a", "spare1"), want: "granted"},
			{q: req("j", 1, "restore:a", "spare1"), release: true},
			{q: req("j", 1, "failover:node1-x", "spare2"), want: "granted"},
		}},
		{"released newer incarnation still refuses older ones", []step{
			{q: req("j", 2, "restore:a", "spare1"), want: "granted"},
			{q: req("j", 2, "restore:a", "spare1"), release: true},
			{q: req("j", 1, "restore:b", "spare1"), want: "conflict"},
		}},
		{"release by another holder is ignored", []step{
			{q: req("j", 1, "restore:a", "spare1"), want: "granted"},
			{q: req("j", 1, "restore:b", "spare1"), release: true},
			{q: req("j", 1, "restore:b", "spare1"), want: "conflict"},
		}},
		{"jobs are independent", []step{
			{q: req("j", 3, "restore:a", "spare1"), want: "granted"},
			{q: req("k", 1, "restore:b", "node2"), want: "granted"},
		}},
		{"incarnation 0 is never granted", []step{{q: req("j", 0, "restore:a", "spare1"), want: "invalid"}}},
		{"empty holder", []step{{q: req("j", 1, "", "spare1"), want: "invalid"}}},
		{"control bytes in a holder", []step{{q: req("j", 1, "a\nb", "spare1"), want: "invalid"}}},
		{"overlong job", []step{{q: req(strings.Repeat("j", 129), 1, "a", "spare1"), want: "invalid"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := open(t, filepath.Join(t.TempDir(), "grants.json"), Options{})
			for i, s := range tt.steps {
				now := t0.Add(time.Duration(i) * time.Second)
				if s.release {
					if err := r.Release(s.q.Job, s.q.Incarnation, s.q.Holder, s.q.Host, now); err != nil {
						t.Fatalf("step %d release: %v", i, err)
					}
					continue
				}
				rec, err := r.Grant(s.q, now)
				var ce *ConflictError
				switch s.want {
				case "granted":
					if err != nil || rec.Incarnation != s.q.Incarnation || rec.Holder != s.q.Holder || rec.Host != s.q.Host {
						t.Fatalf("step %d %+v: got %+v, %v; want granted", i, s.q, rec, err)
					}
				case "conflict":
					if !errors.As(err, &ce) || !errors.Is(err, ErrConflict) {
						t.Fatalf("step %d %+v: got %+v, %v; want a conflict", i, s.q, rec, err)
					}
					if ce.Record.Incarnation < s.q.Incarnation {
						t.Fatalf("step %d: conflict names older incarnation %d", i, ce.Record.Incarnation)
					}
				case "invalid":
					if err == nil || errors.As(err, &ce) {
						t.Fatalf("step %d %+v: got %+v, %v; want a validation error", i, s.q, rec, err)
					}
				}
			}
		})
	}
}

func TestGrantIdempotentKeepsFirstTime(t *testing.T) {
	r := open(t, filepath.Join(t.TempDir(), "grants.json"), Options{})
	q := req("j", 1, "restore:a", "spare1")
	if _, err := r.Grant(q, t0); err != nil {
		t.Fatal(err)
	}
	rec, err := r.Grant(q, t0.Add(time.Minute))
	if err != nil || !rec.Granted.Equal(t0) {
		t.Fatalf("re-grant: %+v %v; want the first grant's time %s", rec, err, t0)
	}
	_, err = r.Grant(req("j", 1, "restore:b", "node3"), t0.Add(2*time.Minute))
	if err == nil || !strings.Contains(err.Error(), "granted to restore:a on spare1 at 12:03:04 UTC") {
		t.Fatalf("refusal %v does not say who holds the incarnation and since when", err)
	}
}

func TestPersistenceAcrossReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "grants.json")
	r := open(t, path, Options{})
	if _, err := r.Grant(req("j", 2, "restore:a", "spare1"), t0); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Grant(req("k", 1, "restore:b", "node2"), t0); err != nil {
		t.Fatal(err)
	}
	if err := r.Release("k", 1, "restore:b", "node2", t0); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("registry file: %v %v; want mode 0600", st, err)
	}
	r2 := open(t, path, Options{})
	if _, err := r2.Grant(req("j", 2, "restore:c", "node3"), t0.Add(time.Second)); !errors.Is(err, ErrConflict) {
		t.Fatalf("after reopen, a competing grant of j/2: %v; want a conflict", err)
	}
	if _, err := r2.Grant(req("j", 1, "restore:c", "node3"), t0.Add(time.Second)); !errors.Is(err, ErrConflict) {
		t.Fatalf("after reopen, an older grant of j: %v; want a conflict", err)
	}
	if rec, ok := r2.Lookup("k"); !ok || !rec.Released {
		t.Fatalf("after reopen, k: %+v %v; want released", rec, ok)
	}
	if _, err := r2.Grant(req("k", 1, "restore:d", "node3"), t0.Add(time.Second)); err != nil {
		t.Fatalf("after reopen, the released k/1: %v", err)
	}
}

func TestOpenRefusesDamagedFile(t *testing.T) {
	tests := []struct{ name, content string }{
		{"truncated", `{"version":1,"jobs":{"j":{"incarnation":1,`},
		{"unknown field", `{"version":1,"jobs":{},"extra":1}`},
		{"future version", `{"version":2,"jobs":{}}`},
		{"incarnation 0", `{"version":1,"jobs":{"j":{"incarnation":0,"holder":"a","host":"b"}}}`},
		{"bad holder", `{"version":1,"jobs":{"j":{"incarnation":1,"holder":"","host":"b"}}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "grants.json")
			if err := os.WriteFile(path, []byte(tt.content), 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := Open(path, Options{}); err == nil || !strings.Contains(err.Error(), path) {
				t.Fatalf("Open of a damaged registry: %v; want an error naming the file", err)
			}
			if b, _ := os.ReadFile(path); string(b) != tt.content {
				t.Fatal("the damaged registry was changed")
			}
		})
	}
}

func TestBoundedSize(t *testing.T) {
	tests := []struct {
		name     string
		opts     Options
		jobs     int           // granted one per second from t0
		at       time.Duration // time of the last grant after t0
		wantLen  int
		wantGone []string
		wantKept []string
	}{
		{name: "max jobs: the longest unseen go", opts: Options{MaxJobs: 3}, jobs: 5, at: 5 * time.Second,
			wantLen: 3, wantGone: []string{"job0", "job1", "job2"}, wantKept: []string{"job3", "job4", "last"}},
		{name: "max age: jobs unseen for long go", opts: Options{MaxAge: time.Hour}, jobs: 4, at: 2 * time.Hour,
			wantLen: 1, wantGone: []string{"job0", "job3"}, wantKept: []string{"last"}},
		{name: "within bounds nothing goes", opts: Options{MaxJobs: 10, MaxAge: time.Hour}, jobs: 4, at: 30 * time.Minute,
			wantLen: 5, wantKept: []string{"job0", "job3", "last"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "grants.json")
			r := open(t, path, tt.opts)
			for i := range tt.jobs {
				if _, err := r.Grant(req(fmt.Sprintf("job%d", i), 1, "h", "spare1"), t0.Add(time.Duration(i)*time.Second)); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := r.Grant(req("last", 1, "h", "spare1"), t0.Add(tt.at)); err != nil {
				t.Fatal(err)
			}
			r2 := open(t, path, tt.opts) // the bound holds on disk too
			for _, reg := range []*Registry{r, r2} {
				if reg.Len() != tt.wantLen {
					t.Errorf("%d jobs remembered, want %d", reg.Len(), tt.wantLen)
				}
				for _, j := range tt.wantGone {
					if _, ok := reg.Lookup(j); ok {
						t.Errorf("%s still remembered", j)
					}
				}
				for _, j := range tt.wantKept {
					if _, ok := reg.Lookup(j); !ok {
						t.Errorf("%s forgotten", j)
					}
				}
			}
		})
	}
}

func TestSeenKeepsAJob(t *testing.T) {
	// A request about a job, even a refused one, counts as seeing it: the job that is asked about stays.
	r := open(t, filepath.Join(t.TempDir(), "grants.json"), Options{MaxJobs: 2})
	for i, j := range []string{"a", "b"} {
		if _, err := r.Grant(req(j, 1, "h", "spare1"), t0.Add(time.Duration(i)*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := r.Grant(req("a", 1, "other", "node3"), t0.Add(5*time.Second)); !errors.Is(err, ErrConflict) {
		t.Fatalf("competing request: %v", err)
	}
	if _, err := r.Grant(req("c", 1, "h", "spare1"), t0.Add(6*time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, ok := r.Lookup("a"); !ok {
		t.Error("a, asked about last, was forgotten")
	}
	if _, ok := r.Lookup("b"); ok {
		t.Error("b, unseen longest, is still remembered")
	}
}

func TestMajority(t *testing.T) {
	granted := func(m string) Answer { return Answer{Member: m, Granted: true} }
	silent := func(m string) Answer { return Answer{Member: m, Err: errors.New("dial: i/o timeout")} }
	held := func(m string, n uint64, holder, host string, released bool) Answer {
		return Answer{Member: m, Conflict: &Record{Incarnation: n, Holder: holder, Host: host, Granted: t0, Released: released}}
	}
	tests := []struct {
		name      string
		members   int
		answers   []Answer
		won       bool
		contended bool
		errHas    []string
		noMaj     bool
	}{
		{name: "alone", members: 1, answers: []Answer{granted("self")}, won: true},
		{name: "self and one of three", members: 3, answers: []Answer{granted("self"), granted("node2"), silent("node3")}, won: true},
		{name: "self only of three", members: 3, answers: []Answer{granted("self"), silent("node2"), silent("node3")},
			noMaj: true, errHas: []string{"1 of 3 members granted, 2 needed", "node2: dial: i/o timeout"}},
		{name: "half of four is not a majority", members: 4, answers: []Answer{granted("self"), granted("node2"), silent("node1"), silent("node3")},
			noMaj: true, errHas: []string{"2 of 4 members granted, 3 needed"}},
		{name: "three of four, the crashed node silent", members: 4, answers: []Answer{granted("spare1"), granted("node2"), granted("node3"), silent("node1")}, won: true},
		{name: "a member missing from the answers counts against", members: 4, answers: []Answer{granted("spare1"), granted("node2")},
			noMaj: true},
		{name: "one refusal beats a majority", members: 5,
			answers: []Answer{granted("a"), granted("b"), granted("c"), held("d", 1, "restore:x", "spare1", false), silent("e")},
			errHas:  []string{"job j already runs as incarnation 1 on spare1 (granted 12:03:04 UTC to restore:x; recorded by d)"}, contended: true},
		{name: "the newest refusal is named", members: 3,
			answers: []Answer{held("node2", 1, "restore:x", "spare1", false), held("node3", 2, "failover:y", "node3", false), granted("self")},
			errHas:  []string{"already runs as incarnation 2 on node3", "recorded by node3)"}},
		{name: "members that recorded the same grant are listed", members: 3,
			answers: []Answer{held("node3", 1, "restore:x", "spare1", false), held("node2", 1, "restore:x", "spare1", false), held("spare1", 1, "restore:x", "spare1", false)},
			errHas:  []string{"recorded by node2, node3, spare1"}}, // the other holder won: no point retrying
		{name: "a split between two holders is contention", members: 4,
			answers: []Answer{granted("spare1"), granted("node2"), held("node3", 1, "restore:x", "node3", false), held("node4", 1, "restore:x", "node3", false)},
			errHas:  []string{"already runs as incarnation 1 on node3"}, contended: true},
		{name: "a released newer incarnation is not contention", members: 3,
			answers: []Answer{granted("self"), held("node2", 3, "restore:x", "spare1", true), granted("node3")},
			errHas:  []string{"incarnation 3 was granted to restore:x on spare1", "given back unused", "would be incarnation 1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tl := Count(tt.members, tt.answers)
			if tl.Won() != tt.won {
				t.Fatalf("won %v, want %v (%+v)", tl.Won(), tt.won, tl)
			}
			err := tl.Err("j", 1)
			if tt.won != (err == nil) {
				t.Fatalf("Err %v with won %v", err, tt.won)
			}
			if got := tl.Contended(1); got != tt.contended {
				t.Errorf("contended %v, want %v", got, tt.contended)
			}
			if errors.Is(err, ErrNoMajority) != tt.noMaj {
				t.Errorf("Err %v: ErrNoMajority %v, want %v", err, errors.Is(err, ErrNoMajority), tt.noMaj)
			}
			if !tt.won && !tt.noMaj && !errors.Is(err, ErrConflict) {
				t.Errorf("refusal %v is not an ErrConflict", err)
			}
			for _, s := range tt.errHas {
				if err == nil || !strings.Contains(err.Error(), s) {
					t.Errorf("error %v does not contain %q", err, s)
				}
			}
		})
	}
}

// TestRaceForOneIncarnation: two holders ask the same members for the same incarnation in every order of
// arrival; at most one may run the job.
func TestRaceForOneIncarnation(t *testing.T) {
	members := []string{"m0", "m1", "m2", "m3", "m4"}
	// first[i] says which holder reaches member i first.
	for mask := 0; mask < 1<<len(members); mask++ {
		regs := make([]*Registry, len(members))
		dir := t.TempDir()
		for i := range members {
			regs[i] = open(t, filepath.Join(dir, members[i]+".json"), Options{})
		}
		answers := map[string][]Answer{}
		ask := func(i int, holder string) {
			_, err := regs[i].Grant(req("j", 1, holder, holder+"-host"), t0)
			a := Answer{Member: members[i], Granted: err == nil}
			var ce *ConflictError
			if errors.As(err, &ce) {
				a.Conflict = &ce.Record
			}
			answers[holder] = append(answers[holder], a)
		}
		for i := range members {
			if mask&(1<<i) != 0 {
				ask(i, "A")
				ask(i, "B")
			} else {
				ask(i, "B")
				ask(i, "A")
			}
		}
		wonA, wonB := Count(len(members), answers["A"]).Won(), Count(len(members), answers["B"]).Won()
		if wonA && wonB {
			t.Fatalf("arrival order %05b: both holders won", mask)
		}
	}
}

// FuzzOpen: whatever the registry file holds, Open either refuses it or yields records that validate and
// survive a save and reopen.
func FuzzOpen(f *testing.F) {
	f.Add([]byte(`{"version":1,"jobs":{"j":{"incarnation":1,"holder":"restore:a","host":"spare1","granted":"2026-03-01T12:03:04Z","seen":"2026-03-01T12:03:04Z"}}}`))
	f.Add([]byte(`{"version":1,"jobs":{"j":{"incarnation":2,"holder":"h","host":"n","granted":"2026-03-01T12:03:04Z","seen":"2026-03-01T12:03:04Z","released":true}}}`))
	f.Add([]byte(`{"version":1,"jobs":{}}`))
	f.Add([]byte(`{"version":1,"jobs":{"":{"incarnation":1,"holder":"h","host":"n"}}}`))
	f.Add([]byte(`{"version":1,"jobs":{"j":{"incarnation":18446744073709551615,"holder":"h","host":"n"}}}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) {
		path := filepath.Join(t.TempDir(), "grants.json")
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		r, err := Open(path, Options{})
		if err != nil {
			return
		}
		r.mu.Lock()
		for job, rec := range r.jobs {
			if checkText("job", job, maxJob) != nil || rec.Validate() != nil {
				t.Fatalf("Open accepted an invalid record %q: %+v", job, rec)
			}
		}
		r.mu.Unlock()
		if _, err := r.Grant(req("fuzz-job", 1, "h", "n"), t0); err != nil && !errors.Is(err, ErrConflict) {
			t.Fatalf("grant on an accepted registry: %v", err)
		}
		r2, err := Open(path, Options{})
		if err != nil {
			t.Fatalf("reopen after save: %v", err)
		}
		if r2.Len() != r.Len() {
			t.Fatalf("reopen lost records: %d, had %d", r2.Len(), r.Len())
		}
	})
}

// TestFloodEvictsTheFloodersGrants: a member that asks for grants of made-up jobs until the registry is
// full evicts its own grants, not another host's: a running job's grant stays, and a stale restore of it
// is refused. Before, the longest unseen went whoever held it.
func TestFloodEvictsTheFloodersGrants(t *testing.T) {
	r, err := Open(filepath.Join(t.TempDir(), "grants.json"), Options{MaxJobs: 8})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	if _, err := r.Grant(Request{Job: "real-job", Incarnation: 1, Holder: "failover:n3-1", Host: "spare1"}, t0); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Grant(Request{Job: "done-job", Incarnation: 1, Holder: "restore:x", Host: "n5"}, t0); err != nil {
		t.Fatal(err)
	}
	if err := r.Release("done-job", 1, "restore:x", "n5", t0); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		if _, err := r.Grant(Request{Job: fmt.Sprintf("junk-%d", i), Incarnation: 1, Holder: "x", Host: "n2"}, t0.Add(time.Duration(i+1)*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	if r.Len() != 8 {
		t.Errorf("%d jobs remembered, want the bound 8", r.Len())
	}
	if _, ok := r.Lookup("done-job"); ok {
		t.Error("a released grant outlived the flooder's own")
	}
	if _, err := r.Grant(Request{Job: "real-job", Incarnation: 1, Holder: "restore:stale", Host: "n4"}, t0.Add(time.Minute)); err == nil {
		t.Fatal("incarnation 1 of real-job granted a second time, to another host: its grant was evicted by another member's requests for made-up jobs")
	}
}

// TestRefusedOnlyOn: a recovery supersedes the incarnations members granted to restores on the host it
// fenced only if every refusal not given back is one; one member's grant to a copy on another host means
// the job runs there. Before, only the newest refusal was looked at.
func TestRefusedOnlyOn(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	onN3 := Record{Incarnation: 1, Holder: "failover:n9-1", Host: "n3", Granted: t0.Add(10 * time.Second), Seen: t0}
	onN2 := Record{Incarnation: 1, Holder: "restore:live", Host: "n2", Granted: t0, Seen: t0}
	gaveBack := onN2
	gaveBack.Released = true
	for _, tc := range []struct {
		name      string
		conflicts []Record
		want      bool
	}{
		{"every refusal a grant on the fenced host", []Record{onN3, onN3}, true},
		{"one grant to a copy on an alive host, older", []Record{onN3, onN2}, false},
		{"a grant on another host given back", []Record{onN3, gaveBack}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var answers []Answer
			for i, c := range tc.conflicts {
				answers = append(answers, Answer{Member: fmt.Sprintf("m%d", i), Conflict: &c})
			}
			var refused *RefusedError
			if err := Count(5, answers).Err("j", 1); !errors.As(err, &refused) {
				t.Fatalf("Err = %v, want a refusal", err)
			}
			if refused.Record.Host != "n3" && !tc.conflicts[0].Released {
				t.Errorf("newest refusal %+v, want n3's", refused.Record)
			}
			if got := refused.OnlyOn("n3"); got != tc.want {
				t.Errorf("OnlyOn(n3) = %v, want %v (refusals %+v)", got, tc.want, refused.All)
			}
		})
	}
}

// TestGrantHeldUntilGivenBack: a grant whose holder died before it ran or gave it back is never
// superseded by another holder of the same incarnation, on any host, nor does it age out while restores
// keep asking; only a newer incarnation (a forced restore) is granted.
func TestGrantHeldUntilGivenBack(t *testing.T) {
	r, err := Open(filepath.Join(t.TempDir(), "grants.json"), Options{MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, err := r.Grant(Request{Job: "j-1", Incarnation: 2, Holder: "restore:dead", Host: "h1"}, now); err != nil {
		t.Fatal(err)
	}
	for i, q := range []Request{
		{Job: "j-1", Incarnation: 2, Holder: "restore:again", Host: "h1"},
		{Job: "j-1", Incarnation: 2, Holder: "failover:x", Host: "h2"},
	} {
		now = now.Add(59 * time.Minute) // each refused request refreshes Seen: never older than MaxAge
		if _, err := r.Grant(q, now); !errors.Is(err, ErrConflict) {
			t.Fatalf("request %d: %v, want a refusal", i, err)
		}
	}
	if _, err := r.Grant(Request{Job: "j-1", Incarnation: 3, Holder: "restore:force", Host: "h2"}, now); err != nil {
		t.Fatalf("newer incarnation: %v", err)
	}
}

// TestSeenSurvivesRestart: a refused request refreshes a grant's last-seen time, which keeps it from aging
// out while restores keep asking (TestGrantHeldUntilGivenBack). The refresh was kept in memory only, until
// the next change: after a restart the grant aged out from its older time, and an older incarnation, a
// stale restore's, was granted while the newer one ran.
func TestSeenSurvivesRestart(t *testing.T) {
	tests := []struct {
		name  string
		again Request // the request that refreshes the grant before the restart
	}{
		{"refused request", req("j", 2, "restore:again", "h2")},
		{"same request again", req("j", 2, "restore:a", "h1")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "grants.json")
			opts := Options{MaxAge: time.Hour}
			r := open(t, path, opts)
			if _, err := r.Grant(req("j", 2, "restore:a", "h1"), t0); err != nil {
				t.Fatal(err)
			}
			if _, err := r.Grant(tt.again, t0.Add(59*time.Minute)); err != nil && !errors.Is(err, ErrConflict) {
				t.Fatal(err)
			}
			r = open(t, path, opts) // the agent restarts
			if _, err := r.Grant(req("k", 1, "restore:b", "h2"), t0.Add(90*time.Minute)); err != nil {
				t.Fatal(err)
			}
			if _, err := r.Grant(req("j", 1, "restore:stale", "h3"), t0.Add(91*time.Minute)); !errors.Is(err, ErrConflict) {
				t.Fatalf("stale restore of j, 32 min after the last request about it: %v, want a refusal (incarnation 2 runs)", err)
			}
		})
	}
}
