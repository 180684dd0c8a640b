package spare

import (
	"errors"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ring"
)

const gib = 1 << 30

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func claim(failure, by, failed string, mem int64) Claim {
	return Claim{Failure: failure, By: by, Failed: failed, Need: Need{Jobs: 2, MemoryBytes: mem}, At: t0}
}

func withSpares(c Claim, spares ...string) Claim {
	c.Spares = spares
	return c
}

func open(t *testing.T) (*Holder, string) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "claim.json")
	h, err := OpenHolder(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := h.Current(); ok {
		t.Fatal("a new holder is claimed")
	}
	return h, p
}

func TestClaim(t *testing.T) {
	first := claim("f1", "n3", "n2", gib)
	for _, tc := range []struct {
		name    string
		held    *Claim // claimed before the test claim
		c       Claim
		avail   int64
		busy    bool     // want ErrBusy
		err     []string // substrings the error must contain; nil: success
		current Claim    // what the holder serves afterwards
	}{
		{name: "free, enough memory", c: first, avail: 2 * gib, current: first},
		{name: "exactly need plus 10%", c: claim("f1", "n3", "n2", 1000), avail: 1100, current: claim("f1", "n3", "n2", 1000)},
		{name: "one byte short", c: claim("f1", "n3", "n2", 1000), avail: 1099, busy: true,
			err: []string{"1099 bytes available", "2 jobs of n2 need 1000 bytes", "(1100)"}},
		{name: "headroom rounds up", c: claim("f1", "n3", "n2", 1001), avail: 1101, busy: true, err: []string{"(1102)"}},
		{name: "need overflows", c: claim("f1", "n3", "n2", math.MaxInt64), avail: math.MaxInt64, busy: true, err: []string{"plus 10% headroom"}},
		{name: "zero need", c: claim("f1", "n3", "n2", 0), avail: 0, current: claim("f1", "n3", "n2", 0)},
		{name: "same failure again", held: &first, c: claim("f1", "n4", "n2", 5*gib), avail: 0, current: first},
		{name: "other failure", held: &first, c: claim("f2", "n1", "n4", 1), avail: 2 * gib, busy: true,
			err: []string{"claimed by n3 for failed node n2 (failure f1) since 2026-03-01T12:00:00Z"}, current: first},
		{name: "same failure id, other node", held: &first, c: claim("f1", "n1", "n4", 1), avail: 2 * gib, busy: true,
			err: []string{"claimed here for node n2, not n4"}, current: first},
		{name: "no failure id", c: claim("", "n3", "n2", 1), avail: gib, err: []string{"without a failure id"}},
		// The failure id names the spare's recovery record (recoveries/<id>.json under the root agent's state
		// directory), read when a later claim comes: a claimer's id must not lead out of it, nor be one no
		// recovery record can be saved under.
		{name: "a failure id that leads out of the state directory", c: claim("../../../etc/x", "n3", "n2", 1), avail: gib,
			err: []string{"failure id", "not usable as a file name"}},
		{name: "a failure id with a slash", c: claim("n2/x", "n3", "n2", 1), avail: gib, err: []string{"not usable as a file name"}},
		{name: "a hidden failure id", c: claim(".n2", "n3", "n2", 1), avail: gib, err: []string{"not usable as a file name"}},
		{name: "a failure id with a control byte", c: claim("n2-\n20260301", "n3", "n2", 1), avail: gib, err: []string{"not usable as a file name"}},
		{name: "an over-long failure id", c: claim(strings.Repeat("f", maxFailure+1), "n3", "n2", 1), avail: gib, err: []string{"failure id of 201 bytes"}},
		{name: "the failure id a protector makes", c: claim("node-2.rack1-20260301T120000.000", "n3", "n2", 1), avail: gib,
			current: claim("node-2.rack1-20260301T120000.000", "n3", "n2", 1)},
		{name: "no requester", c: claim("f1", "", "n2", 1), avail: gib, err: []string{"without a requesting member"}},
		{name: "no failed node", c: claim("f1", "n3", "", 1), avail: gib, err: []string{"without a failed node"}},
		{name: "negative need", c: claim("f1", "n3", "n2", -1), avail: gib, err: []string{"negative need"}},
		{name: "for a run, kept with its spares", c: withSpares(claim("f1", "n3", "n2", 1), "n5", "n6"), avail: gib,
			current: withSpares(claim("f1", "n3", "n2", 1), "n5", "n6")},
		{name: "a run's spare that is no member name", c: withSpares(claim("f1", "n3", "n2", 1), "n5", "a/b"), avail: gib,
			err: []string{"a spare of the run"}},
		{name: "more spares than a run has", c: withSpares(claim("f1", "n3", "n2", 1), make([]string, MaxRunSpares+1)...), avail: gib,
			err: []string{"4097 spares of the run, at most 4096"}},
		{name: "snapshots to prefetch, kept", c: withPrefetch(claim("f1", "n3", "n2", 1), Prefetch{Job: "j-1", Snapshot: "s", Source: "n3"}), avail: gib,
			current: withPrefetch(claim("f1", "n3", "n2", 1), Prefetch{Job: "j-1", Snapshot: "s", Source: "n3"})},
		{name: "a prefetch holder that is no member name", c: withPrefetch(claim("f1", "n3", "n2", 1), Prefetch{Job: "j", Snapshot: "s", Source: "../x"}),
			avail: gib, err: []string{"the holder of a snapshot to prefetch"}},
		{name: "more prefetches than jobs a recovery takes", c: withPrefetch(claim("f1", "n3", "n2", 1), make([]Prefetch, MaxPrefetch+1)...),
			avail: gib, err: []string{"1025 snapshots to prefetch, at most 1024"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, p := open(t)
			if tc.held != nil {
				if err := h.Claim(*tc.held, math.MaxInt64); err != nil {
					t.Fatal(err)
				}
			}
			err := h.Claim(tc.c, tc.avail)
			if errors.Is(err, ErrBusy) != tc.busy {
				t.Errorf("err %v, busy want %v", err, tc.busy)
			}
			if tc.err == nil && err != nil {
				t.Fatalf("unexpected error %v", err)
			}
			for _, s := range tc.err {
				if err == nil || !strings.Contains(err.Error(), s) {
					t.Errorf("err %v, want one containing %q", err, s)
				}
			}
			got, ok := h.Current()
			if ok != (tc.current.Failure != "") || !reflect.DeepEqual(got, tc.current) {
				t.Errorf("Current = %+v %v, want %+v", got, ok, tc.current)
			}
			// What is on disk is what a restarted agent sees.
			r, err := OpenHolder(p)
			if err != nil {
				t.Fatal(err)
			}
			rgot, rok := r.Current()
			if rok != ok || !rgot.At.Equal(got.At) {
				t.Errorf("reopened holder has %+v %v, want %+v %v", rgot, rok, got, ok)
			}
			rgot.At, got.At = time.Time{}, time.Time{}
			if !reflect.DeepEqual(rgot, got) {
				t.Errorf("reopened holder has %+v, want %+v", rgot, got)
			}
		})
	}
}

func TestRelease(t *testing.T) {
	h, p := open(t)
	if err := h.Release("f1"); err != nil {
		t.Fatalf("release of a free spare: %v", err)
	}
	c := claim("f1", "n3", "n2", gib)
	if err := h.Claim(c, 2*gib); err != nil {
		t.Fatal(err)
	}
	if err := h.Release("f2"); err == nil || !strings.Contains(err.Error(), "claimed for failure f1") {
		t.Fatalf("release of another failure: %v", err)
	}
	if _, ok := h.Current(); !ok {
		t.Fatal("a refused release freed the spare")
	}
	if err := h.Release("f1"); err != nil {
		t.Fatal(err)
	}
	if _, ok := h.Current(); ok {
		t.Fatal("still claimed after release")
	}
	r, err := OpenHolder(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := r.Current(); ok {
		t.Fatal("reopened holder is still claimed after release")
	}
	// Free again: another failure can claim it.
	if err := h.Claim(claim("f2", "n1", "n4", 1), gib); err != nil {
		t.Fatal(err)
	}
}

func TestPersistFailureChangesNothing(t *testing.T) {
	dir := t.TempDir()
	h, err := OpenHolder(filepath.Join(dir, "sub", "claim.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Claim(claim("f1", "n3", "n2", 1), gib); err == nil || !strings.Contains(err.Error(), "persist spare claim") {
		t.Fatalf("claim without a writable state file: %v", err)
	}
	if _, ok := h.Current(); ok {
		t.Fatal("claimed in memory although the claim was not persisted")
	}
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := h.Claim(claim("f1", "n3", "n2", 1), gib); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(dir, "sub")); err != nil {
		t.Fatal(err)
	}
	if err := h.Release("f1"); err == nil {
		t.Fatal("release without a writable state file succeeded")
	}
	if _, ok := h.Current(); !ok {
		t.Fatal("released in memory although the release was not persisted")
	}
}

func TestOpenHolderRefusesBadState(t *testing.T) {
	for _, tc := range []struct {
		name, content, err string
	}{
		{"torn", `{"claim":{"failure":"f1"`, "unreadable"},
		{"not json", `claimed`, "unreadable"},
		{"unknown field", `{"claim":null,"owner":"x"}`, "unreadable"},
		{"claim without failure", `{"claim":{"by":"n3","failed":"n2"}}`, "without a failure id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "claim.json")
			if err := os.WriteFile(p, []byte(tc.content), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := OpenHolder(p)
			if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "remove it only if") {
				t.Fatalf("err %v, want one containing %q and advice", err, tc.err)
			}
		})
	}
	// A path that cannot be read (a directory) is an error, not a free spare.
	if _, err := OpenHolder(t.TempDir()); err == nil {
		t.Fatal("opening a directory as the claim file succeeded")
	}
}

func TestConcurrentClaimsOneWins(t *testing.T) {
	h, _ := open(t)
	const n = 16
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			errs[i] = h.Claim(claim("f"+string(rune('a'+i)), "n1", "node"+string(rune('a'+i)), 1), gib)
		})
	}
	wg.Wait()
	won := 0
	for _, err := range errs {
		switch {
		case err == nil:
			won++
		case !errors.Is(err, ErrBusy):
			t.Errorf("unexpected error %v", err)
		}
	}
	cur, ok := h.Current()
	if won != 1 || !ok {
		t.Fatalf("%d claims won, current %+v %v; want exactly one", won, cur, ok)
	}
}

func TestWithHeadroom(t *testing.T) {
	for _, tc := range []struct {
		need, want int64
		ok         bool
	}{
		{0, 0, true},
		{1, 2, true},
		{10, 11, true},
		{15, 17, true},
		{gib, gib + gib/10 + 1, true},
		{math.MaxInt64 / 11 * 10, math.MaxInt64 / 11 * 11, true},
		{math.MaxInt64, math.MaxInt64, false},
	} {
		got, ok := withHeadroom(tc.need)
		if got != tc.want || ok != tc.ok {
			t.Errorf("withHeadroom(%d) = %d %v, want %d %v", tc.need, got, ok, tc.want, tc.ok)
		}
	}
}

func TestOrder(t *testing.T) {
	m := func(name string, role ring.Role, state ring.State) ring.Member {
		return ring.Member{Name: name, Address: netip.MustParseAddrPort("10.0.0.1:1"), Role: role, State: state}
	}
	spares := []ring.Member{
		m("s3", ring.RoleSpare, ring.StateAlive),
		m("s1", ring.RoleSpare, ring.StateAlive),
		m("s2", ring.RoleSpare, ring.StateFailed),
		m("n1", ring.RoleNode, ring.StateAlive),
		m("s4", ring.RoleSpare, ring.StateAlive),
	}
	for _, tc := range []struct {
		name   string
		spares []ring.Member
		tried  map[string]bool
		want   []string
	}{
		{"none tried keeps FIFO order", spares, nil, []string{"s3", "s1", "s4"}},
		{"tried skipped", spares, map[string]bool{"s3": true, "s4": true}, []string{"s1"}},
		{"tried false is not tried", spares, map[string]bool{"s3": false}, []string{"s3", "s1", "s4"}},
		{"all tried", spares, map[string]bool{"s1": true, "s3": true, "s4": true}, nil},
		{"no spares", nil, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Order(tc.spares, tc.tried); !slices.Equal(got, tc.want) {
				t.Errorf("Order = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestRunOrder: a run's spares are tried in the run's order, alive ones only, never the failed node; an
// alive node is claimed as a node (absorbs), a ring spare as a spare (replaces).
func TestRunOrder(t *testing.T) {
	v, err := ring.New([]ring.Member{
		{Name: "n1", Address: netip.MustParseAddrPort("10.0.0.1:1"), Role: ring.RoleNode},
		{Name: "n2", Address: netip.MustParseAddrPort("10.0.0.2:1"), Role: ring.RoleNode},
		{Name: "n3", Address: netip.MustParseAddrPort("10.0.0.3:1"), Role: ring.RoleNode},
		{Name: "n4", Address: netip.MustParseAddrPort("10.0.0.4:1"), Role: ring.RoleNode},
		{Name: "s1", Address: netip.MustParseAddrPort("10.0.0.11:1"), Role: ring.RoleSpare},
	})
	if err != nil {
		t.Fatal(err)
	}
	n4gone, err := v.Fail("n4")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		v      ring.View
		spares []string
		tried  map[string]bool
		want   []Target
	}{
		{"the run's order, nodes and ring spares", v, []string{"n4", "s1", "n3"}, nil,
			[]Target{{"n4", true}, {"s1", false}, {"n3", true}}},
		{"a failed spare is skipped", n4gone, []string{"n4", "n3"}, nil, []Target{{"n3", true}}},
		{"the failed node is never its own spare", v, []string{"n2", "n3"}, nil, []Target{{"n3", true}}},
		{"strangers are skipped", v, []string{"x9", "n3"}, nil, []Target{{"n3", true}}},
		{"tried ones are skipped", v, []string{"n3", "n4"}, map[string]bool{"n3": true}, []Target{{"n4", true}}},
		{"no spares", v, nil, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := RunOrder(tc.v, tc.spares, "n2", tc.tried); !slices.Equal(got, tc.want) {
				t.Errorf("RunOrder = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestParseMemAvailable(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     int64
		err      string
	}{
		{"typical", "MemTotal:       16384000 kB\nMemFree:  1000 kB\nMemAvailable:    8192000 kB\nBuffers: 1 kB\n", 8192000 * 1024, ""},
		{"zero", "MemAvailable: 0 kB\n", 0, ""},
		{"missing", "MemTotal: 1 kB\nMemFree: 1 kB\n", 0, "no MemAvailable"},
		{"empty", "", 0, "no MemAvailable"},
		{"no unit", "MemAvailable: 5\n", 0, "unexpected line"},
		{"other unit", "MemAvailable: 5 MB\n", 0, "unexpected line"},
		{"not a number", "MemAvailable: lots kB\n", 0, "unexpected line"},
		{"negative", "MemAvailable: -5 kB\n", 0, "unexpected line"},
		{"overflow", "MemAvailable: 9223372036854775807 kB\n", 0, "unexpected line"},
		{"line too long", "MemTotal: " + strings.Repeat("9", 70000) + " kB\n", 0, "too long"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseMemAvailable(strings.NewReader(tc.in))
			if tc.err == "" {
				if err != nil || got != tc.want {
					t.Fatalf("got %d %v, want %d", got, err, tc.want)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want one containing %q", err, tc.err)
			}
		})
	}
}

func TestReadMemAvailableErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := readMemAvailable(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	p := filepath.Join(dir, "meminfo")
	if err := os.WriteFile(p, []byte("MemTotal: 1 kB\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readMemAvailable(p); err == nil || !strings.Contains(err.Error(), p) {
		t.Errorf("file without MemAvailable: %v, want an error naming it", err)
	}
}

func TestMemAvailableIsSane(t *testing.T) {
	got, err := MemAvailable()
	if err != nil {
		t.Fatal(err)
	}
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	total := int64(si.Totalram) * int64(si.Unit)
	if got <= 0 || got > total {
		t.Fatalf("MemAvailable %d bytes, want within (0, %d] (total RAM)", got, total)
	}
}

func withPrefetch(c Claim, p ...Prefetch) Claim {
	c.Prefetch = p
	return c
}
