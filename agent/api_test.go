package agent_test

// The local API over a real (minimal) agent: what each uid may see and do is the agent's to decide, so
// these tests serve agentapi's handler over the agent's test fixture (fixture_test.go). The API's own
// mechanics (credentials, limits, time bounds, logs) are tested in agentapi with a fake backend.

import (
	"encoding/json"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/testenv"
)

const (
	ownersJob = agent.OwnersJob
	rootsJob  = agent.RootsJob
	doneJob   = agent.DoneJob
	goneJob   = agent.GoneJob
	theirJob  = agent.TheirJob
	failAfter = 20 * time.Second
)

var asRoot, asOwner, asOther = agent.AsRoot, agent.AsOwner, agent.AsOther

// apiError is the body of every non-2xx answer.
type apiError struct {
	Error string `json:"error"`
}

// call sends one request to the API's handler as cred (nil: a connection whose credentials are unknown).
func call(t *testing.T, h http.Handler, cred *unix.Ucred, method, path, body string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(method, path, strings.NewReader(body))
	if cred != nil {
		r = r.WithContext(agentapi.WithCaller(r.Context(), cred))
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

func decode[T any](t *testing.T, w *httptest.ResponseRecorder) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(w.Body.Bytes(), &v); err != nil {
		t.Fatalf("answer %d %q: %v", w.Code, w.Body.String(), err)
	}
	return v
}

func jobIDs(js []agent.Job) []string {
	var out []string
	for _, j := range js {
		out = append(out, j.ID)
	}
	slices.Sort(out)
	return out
}

// Every endpoint, as root, as the job's owner and as another uid. A refusal must come before any work;
// where the work needs the real system, "allowed" shows as a later, different error.
func TestAPIAuthorization(t *testing.T) {
	ta := agent.NewTestAgent(t)
	h := agentapi.Handler(ta.Agent, agentapi.DefaultLimits())
	snapDirs := func() []string {
		var out []string
		filepath.WalkDir(ta.StoreRoot(), func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() && d.Name() != filepath.Base(ta.StoreRoot()) && filepath.Dir(filepath.Dir(p)) == ta.StoreRoot() {
				out = append(out, filepath.Base(filepath.Dir(p))+"/"+d.Name())
			}
			return nil
		})
		return out
	}
	before := snapDirs()
	noNewWork := func(t *testing.T) {
		t.Helper()
		if got := snapDirs(); !slices.Equal(got, before) {
			t.Errorf("snapshot store changed from %v to %v", before, got)
		}
		if ents, _ := os.ReadDir(filepath.Join(ta.Dir(), "restore")); len(ents) > 0 {
			t.Errorf("a restore was prepared: %v", ents)
		}
		if got := jobIDs(ta.Jobs(0)); !slices.Equal(got, []string{doneJob, ownersJob, rootsJob}) {
			t.Errorf("jobs are now %v", got)
		}
		if ents, _ := os.ReadDir(ta.JobsDir()); len(ents) > 0 {
			t.Errorf("a job directory was made: %v", ents)
		}
	}
	type check func(t *testing.T, w *httptest.ResponseRecorder)
	wantJobs := func(ids ...string) check {
		return func(t *testing.T, w *httptest.ResponseRecorder) {
			if got := jobIDs(decode[[]agent.Job](t, w)); !slices.Equal(got, ids) {
				t.Errorf("jobs %v, want %v", got, ids)
			}
		}
	}
	wantErr := func(s string) check {
		return func(t *testing.T, w *httptest.ResponseRecorder) {
			if e := decode[apiError](t, w); !strings.Contains(e.Error, s) {
				t.Errorf("error %q, want it to mention %q", e.Error, s)
			}
		}
	}
	wantSnaps := func(jobs ...string) check {
		return func(t *testing.T, w *httptest.ResponseRecorder) {
			var got []string
			for _, m := range decode[[]*ckpt.Manifest](t, w) {
				got = append(got, m.Job)
			}
			slices.Sort(got)
			if !slices.Equal(got, jobs) {
				t.Errorf("snapshots of %v, want %v", got, jobs)
			}
		}
	}
	ckptBody := `{"jobs":["` + ownersJob + `"]}`
	restoreBody := `{"snapshot":"` + ta.OwnSnap() + `","job":"` + ownersJob + `"}`
	liveOwner, liveOther := testenv.LiveCaller(t, asOwner.Uid, asOwner.Gid), testenv.LiveCaller(t, asOther.Uid, asOther.Gid)
	tests := []struct {
		name, method, path, body string
		cred                     *unix.Ucred
		code                     int
		check                    check
	}{
		{"status root", "GET", "/v1/status", "", asRoot, 200, func(t *testing.T, w *httptest.ResponseRecorder) {
			if got := jobIDs(decode[agent.Status](t, w).Jobs); !slices.Equal(got, []string{doneJob, ownersJob, rootsJob}) {
				t.Errorf("jobs %v", got)
			}
		}},
		{"status owner", "GET", "/v1/status", "", asOwner, 200, func(t *testing.T, w *httptest.ResponseRecorder) {
			if got := jobIDs(decode[agent.Status](t, w).Jobs); !slices.Equal(got, []string{doneJob, ownersJob}) {
				t.Errorf("jobs %v", got)
			}
		}},
		{"status other", "GET", "/v1/status", "", asOther, 200, func(t *testing.T, w *httptest.ResponseRecorder) {
			if s := decode[agent.Status](t, w); len(s.Jobs) != 0 || s.Node != "node1" {
				t.Errorf("status %+v", s)
			}
		}},

		{"list root", "GET", "/v1/jobs", "", asRoot, 200, wantJobs(doneJob, ownersJob, rootsJob)},
		{"list owner", "GET", "/v1/jobs", "", asOwner, 200, wantJobs(doneJob, ownersJob)},
		{"list other", "GET", "/v1/jobs", "", asOther, 200, wantJobs()},

		// Starting a job needs no authorization (it runs as the caller, from a live process of the caller's:
		// the job gets its limits); the interval floor applies to all, before any work.
		// TestAPIStartJobRunsAsCaller covers the rest.
		{"start root below floor", "POST", "/v1/jobs", `{"argv":["true"],"interval":"1ms"}`, asRoot, 422, wantErr("below this agent's minimum of 1s (checkpoint.min_interval)")},
		{"start owner below floor", "POST", "/v1/jobs", `{"argv":["true"],"interval":"999ms"}`, liveOwner, 422, wantErr("below this agent's minimum of 1s")},
		{"start other zero interval", "POST", "/v1/jobs", `{"argv":["true"],"interval":"0s"}`, liveOther, 422, wantErr("positive duration")},
		{"start other negative interval", "POST", "/v1/jobs", `{"argv":["true"],"interval":"-1m"}`, liveOther, 422, wantErr("positive duration")},

		{"get root", "GET", "/v1/jobs/" + ownersJob, "", asRoot, 200, nil},
		{"get owner", "GET", "/v1/jobs/" + ownersJob, "", asOwner, 200, nil},
		{"get other", "GET", "/v1/jobs/" + ownersJob, "", asOther, 404, wantErr("no such job")},
		{"get owner root's job", "GET", "/v1/jobs/" + rootsJob, "", asOwner, 404, wantErr("no such job")},

		{"wait root", "GET", "/v1/jobs/" + ownersJob + "/wait?timeout=1ms", "", asRoot, 200, nil},
		{"wait owner", "GET", "/v1/jobs/" + ownersJob + "/wait?timeout=1ms", "", asOwner, 200, nil},
		{"wait owner exited", "GET", "/v1/jobs/" + doneJob + "/wait", "", asOwner, 200, nil},
		{"wait other", "GET", "/v1/jobs/" + ownersJob + "/wait?timeout=1ms", "", asOther, 404, wantErr("no such job")},
		{"wait other exited", "GET", "/v1/jobs/" + doneJob + "/wait", "", asOther, 404, wantErr("no such job")},

		// Signals to the owner's job: TestAPISignal (they need a real process).
		{"signal other", "POST", "/v1/jobs/" + ownersJob + "/signal", `{"signal":15}`, asOther, 404, wantErr("no such job")},
		{"signal owner root's job", "POST", "/v1/jobs/" + rootsJob + "/signal", `{"signal":9}`, asOwner, 404, wantErr("no such job")},

		// Allowed: the dump fails (no CRIU here), after authorization.
		{"checkpoint root", "POST", "/v1/checkpoint", ckptBody, asRoot, 500, wantErr("criu")},
		{"checkpoint owner", "POST", "/v1/checkpoint", ckptBody, asOwner, 500, wantErr("criu")},
		{"checkpoint other", "POST", "/v1/checkpoint", ckptBody, asOther, 404, wantErr("no such job")},
		{"checkpoint other mixed", "POST", "/v1/checkpoint", `{"jobs":["` + rootsJob + `","` + ownersJob + `"]}`, asOther, 404, wantErr("no such job")},
		{"checkpoint other all of its own", "POST", "/v1/checkpoint", `{}`, asOther, 200, func(t *testing.T, w *httptest.ResponseRecorder) {
			if r := decode[agentapi.CheckpointReply](t, w); len(r.Results) != 0 || r.Error != "" {
				t.Errorf("a uid without jobs checkpointed %+v", r)
			}
		}},

		{"snapshots root", "GET", "/v1/snapshots", "", asRoot, 200, wantSnaps(goneJob, ownersJob, rootsJob)},
		{"snapshots owner", "GET", "/v1/snapshots", "", asOwner, 200, wantSnaps(goneJob, ownersJob)},
		{"snapshots other", "GET", "/v1/snapshots", "", asOther, 200, wantSnaps()},
		{"snapshots other by job", "GET", "/v1/snapshots?job=" + ownersJob, "", asOther, 200, wantSnaps()},
		{"snapshots bad job name", "GET", "/v1/snapshots?job=../x", "", asOwner, 400, wantErr("job")},

		// Allowed: refused later because the job still runs here.
		{"restore root", "POST", "/v1/restore", restoreBody, asRoot, 409, wantErr("runs on this host")},
		{"restore owner", "POST", "/v1/restore", restoreBody, asOwner, 409, wantErr("runs on this host")},
		{"restore other", "POST", "/v1/restore", restoreBody, asOther, 404, wantErr("no such job")},
		{"restore other forced", "POST", "/v1/restore", `{"snapshot":"` + ta.OwnSnap() + `","job":"` + ownersJob + `","force":true}`, asOther, 403, wantErr("for root")},
		{"restore owner forced", "POST", "/v1/restore", `{"snapshot":"` + ta.OwnSnap() + `","job":"` + ownersJob + `","force":true}`, asOwner, 403, wantErr("for root")},
		{"restore owner job of another node", "POST", "/v1/restore", `{"snapshot":"` + ta.GoneSnap() + `"}`, asOwner, 500, wantErr("incarnation")}, // past authorization: claiming the next incarnation needs members this test lacks,
		{"restore other job found from snapshot", "POST", "/v1/restore", `{"snapshot":"` + ta.GoneSnap() + `"}`, asOther, 404, wantErr("no such job")},

		// Allowed: the request itself is refused.
		{"spares root", "POST", "/v1/spares", `{}`, asRoot, 409, wantErr("a spare needs a name")},
		{"spares owner", "POST", "/v1/spares", `{"name":"s","address":"127.0.0.1:1"}`, asOwner, 403, wantErr("root only")},
		{"spares other", "POST", "/v1/spares", `{"name":"s","address":"127.0.0.1:1"}`, asOther, 403, wantErr("root only")},

		{"log root", "GET", "/v1/log/conns", "", asRoot, 200, nil},
		{"log owner", "GET", "/v1/log/conns", "", asOwner, 403, wantErr("root only")},
		{"log other", "GET", "/v1/log/conns", "", asOther, 403, wantErr("root only")},

		// Events: TestAPIEvents.
	}
	for _, path := range []string{"GET /v1/status", "GET /v1/jobs", "POST /v1/jobs", "GET /v1/jobs/" + ownersJob,
		"GET /v1/jobs/" + ownersJob + "/wait", "POST /v1/jobs/" + ownersJob + "/signal", "POST /v1/checkpoint",
		"GET /v1/snapshots", "POST /v1/restore", "POST /v1/spares", "GET /v1/events", "GET /v1/log/conns"} {
		method, p, _ := strings.Cut(path, " ")
		tests = append(tests, struct {
			name, method, path, body string
			cred                     *unix.Ucred
			code                     int
			check                    check
		}{"no credentials " + path, method, p, `{"signal":9,"jobs":["` + ownersJob + `"],"snapshot":"` + ta.OwnSnap() + `"}`, nil, 403, wantErr("credentials unavailable")})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := call(t, h, tt.cred, tt.method, tt.path, tt.body)
			if w.Code != tt.code {
				t.Fatalf("%s %s: %d %s, want %d", tt.method, tt.path, w.Code, w.Body.String(), tt.code)
			}
			if tt.check != nil {
				tt.check(t, w)
			}
			if tt.code/100 != 2 || tt.method == "GET" {
				noNewWork(t)
			}
		})
	}
}

// A uid may ask for a checkpoint once per checkpoint.min_interval; root is not limited.
func TestAPICheckpointRateLimit(t *testing.T) {
	ta := agent.NewTestAgent(t)
	ta.SetCheckpointFloor(time.Hour) // the second request always comes within it
	h := agentapi.Handler(ta.Agent, agentapi.DefaultLimits())
	body := `{"jobs":["` + ownersJob + `"]}`
	for i, tt := range []struct {
		cred *unix.Ucred
		body string
		code int
	}{
		{asOwner, body, 500}, // allowed: the dump fails without CRIU
		{asOwner, body, 429},
		{asOwner, `{}`, 429},
		{asOther, body, 404}, // refused before it counts: another user's job
		{asRoot, body, 500},
		{asRoot, body, 500},
	} {
		w := call(t, h, tt.cred, "POST", "/v1/checkpoint", tt.body)
		if w.Code != tt.code {
			t.Fatalf("request %d as uid %d: %d %s, want %d", i, tt.cred.Uid, w.Code, w.Body.String(), tt.code)
		}
		if w.Code == 429 && (!strings.Contains(w.Body.String(), "once every 1h0m0s (checkpoint.min_interval)") || w.Header().Get("Retry-After") == "") {
			t.Errorf("429 without the floor or Retry-After: %v %s", w.Header(), w.Body.String())
		}
	}
}

// A checkpoint refused before any dump does not use up the user's one per checkpoint.min_interval, and a job
// named twice is one job, not a job that is not running.
func TestAPICheckpointRefusalsDoNotCount(t *testing.T) {
	type req struct {
		body string
		code int
		err  string // in the answer
	}
	for _, tt := range []struct {
		name string
		reqs []req
	}{
		{"job named twice", []req{
			{`{"jobs":["` + ownersJob + `","` + ownersJob + `"]}`, 500, "criu"}, // allowed: the dump fails without CRIU
			{`{"jobs":["` + ownersJob + `"]}`, 429, "checkpoint.min_interval"},
		}},
		{"ended job first", []req{
			{`{"jobs":["` + doneJob + `"]}`, 404, "not running"},
			{`{"jobs":["` + ownersJob + `"]}`, 500, "criu"},
			{`{"jobs":["` + ownersJob + `"]}`, 429, "checkpoint.min_interval"},
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ta := agent.NewTestAgent(t)
			ta.SetCheckpointFloor(time.Hour) // every later request comes within it
			h := agentapi.Handler(ta.Agent, agentapi.DefaultLimits())
			for i, r := range tt.reqs {
				w := call(t, h, asOwner, "POST", "/v1/checkpoint", r.body)
				if w.Code != r.code || !strings.Contains(w.Body.String(), r.err) {
					t.Fatalf("request %d %s: %d %s, want %d mentioning %q", i, r.body, w.Code, w.Body.String(), r.code, r.err)
				}
			}
		})
	}
}

// Starting a job: it belongs to the caller's uid and gid, whatever the body says. Runs a fake shim that
// reports a pid; chown of the job directory to the test uids needs root.
func TestAPIStartJobRunsAsCaller(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (the agent creates root-owned job directories and hands output files to the caller's uid)")
	}
	ta := agent.NewTestAgent(t)
	// Like the real shim it stays after its report (shim.Launch reaps it, which closes the report's pipe),
	// here until the test ends.
	fakeShim, stop, pids := filepath.Join(ta.Dir(), "fake-shim"), filepath.Join(ta.Dir(), "stop-shims"), filepath.Join(ta.Dir(), "shim-pids")
	script := "#!/bin/sh\necho $$ >>" + pids + "\ncat >/dev/null\necho '{\"pid\": 4242}'\nwhile [ ! -e " + stop + " ]; do sleep 0.1; done\n"
	if err := os.WriteFile(fakeShim, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(stop, nil, 0o644)
		b, _ := os.ReadFile(pids)
		for _, p := range strings.Fields(string(b)) {
			for deadline := time.Now().Add(failAfter); ; time.Sleep(20 * time.Millisecond) {
				if _, err := os.Stat("/proc/" + p); err != nil {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("fake shim %s did not stop", p)
					break
				}
			}
		}
	})
	ta.SetShim(fakeShim)
	h := agentapi.Handler(ta.Agent, agentapi.DefaultLimits())
	// The users' calls come from live processes of theirs: a job runs with its caller's resource limits.
	for _, c := range []*unix.Ucred{asRoot, testenv.LiveCaller(t, asOwner.Uid, asOwner.Gid), testenv.LiveCaller(t, asOther.Uid, asOther.Gid)} {
		w := call(t, h, c, "POST", "/v1/jobs", `{"argv":["true"],"name":"started","interval":"2s","uid":0,"UID":0,"gid":0}`)
		if w.Code != 201 {
			t.Fatalf("start as uid %d: %d %s", c.Uid, w.Code, w.Body.String())
		}
		j := decode[agent.Job](t, w)
		if j.UID != c.Uid || j.GID != c.Gid || j.PID != 4242 {
			t.Errorf("started as uid %d: job of uid %d gid %d pid %d", c.Uid, j.UID, j.GID, j.PID)
		}
		// The job directory stays root's (0755): its user must not be able to plant links in it.
		if st, err := os.Lstat(j.Dir); err != nil || st.Sys().(*syscall.Stat_t).Uid != 0 || st.Mode().Perm() != 0o755 || !st.IsDir() {
			t.Errorf("job directory %s: want a root-owned 0755 directory, got %v (err %v)", j.Dir, st.Mode(), err)
		}
		for _, viewer := range []*unix.Ucred{asRoot, asOwner, asOther} {
			want := 404
			if viewer.Uid == 0 || viewer.Uid == c.Uid {
				want = 200
			}
			if w := call(t, h, viewer, "GET", "/v1/jobs/"+j.ID, ""); w.Code != want {
				t.Errorf("job of uid %d seen by uid %d: %d, want %d", c.Uid, viewer.Uid, w.Code, want)
			}
		}
	}
}

// GET /v1/events: root sees every timeline; a user those that concern its jobs (run here, or held here as
// snapshots), reduced to them; another user nothing.
func TestAPIEvents(t *testing.T) {
	ta := agent.NewTestAgent(t)
	ta.AddFailures(agent.TestFailures())
	h := agentapi.Handler(ta.Agent, agentapi.DefaultLimits())
	for _, tt := range []struct {
		cred *unix.Ucred
		want map[string][]string // failure id -> its jobs as shown
	}{
		{asRoot, map[string][]string{"node2-1": {goneJob, theirJob}, "node4-1": {theirJob + "2"}, "node5-1": {ownersJob}, "node6-1": nil}},
		{asOwner, map[string][]string{"node2-1": {goneJob}, "node5-1": {ownersJob}}},
		{asOther, map[string][]string{}},
	} {
		w := call(t, h, tt.cred, "GET", "/v1/events", "")
		if w.Code != 200 {
			t.Fatalf("uid %d: %d %s", tt.cred.Uid, w.Code, w.Body.String())
		}
		fs := decode[[]*agent.Failure](t, w)
		got := map[string][]string{}
		for _, f := range fs {
			got[f.ID] = f.Jobs
		}
		if tt.cred.Uid != 0 && strings.Contains(w.Body.String(), theirJob) {
			t.Errorf("uid %d sees another user's job %s", tt.cred.Uid, theirJob)
		}
		if len(got) != len(tt.want) {
			t.Errorf("uid %d sees %v, want %v", tt.cred.Uid, got, tt.want)
		}
		for id, jobs := range tt.want {
			if g, ok := got[id]; !ok || !slices.Equal(g, jobs) {
				t.Errorf("uid %d: failure %s with jobs %v, want %v", tt.cred.Uid, id, g, jobs)
			}
		}
	}
}

// TestAPIRestoreOthersSnapshotRefusedFirst: a uid that names another user's job and a snapshot of it this
// host holds is refused before the agent works on the snapshot: no verification of another user's images
// on its behalf (reading and hashing them all), and nothing learnt from its answer (whether the snapshot
// verifies, the job's other snapshots, its owner).
func TestAPIRestoreOthersSnapshotRefusedFirst(t *testing.T) {
	ta := agent.NewTestAgent(t)
	h := agentapi.Handler(ta.Agent, agentapi.DefaultLimits())
	snap := filepath.Join(ta.StoreRoot(), ownersJob, ta.OwnSnap())
	if _, err := os.Stat(snap); err != nil {
		t.Fatal(err)
	}
	// The owner's snapshot fails verification: a stray file.
	if err := os.WriteFile(filepath.Join(snap, "stray"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{
		`{"snapshot":"` + ta.OwnSnap() + `","job":"` + ownersJob + `"}`,
		`{"snapshot":"` + ta.OwnSnap() + `"}`,
	} {
		w := call(t, h, asOther, "POST", "/v1/restore", body)
		if w.Code != 404 || strings.Contains(w.Body.String(), "verif") || strings.Contains(w.Body.String(), "uid 1000") {
			t.Errorf("restore %s as uid %d: %d %s; want 404, telling nothing of the snapshot or its owner", body, asOther.Uid, w.Code, w.Body.String())
		}
	}
}
