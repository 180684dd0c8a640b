package ring

import (
	"math"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// TestRejoin: a failed member comes back as an alive spare at the end of the FIFO under its next
// incarnation, with its own host address only, and only when nobody holds that address.
func TestRejoin(t *testing.T) {
	base := cluster(t) // nodes n1..n4 in ring order, spares s1, s2
	moved := must(t)(base.ReplaceKeepingAddrs("n2", "s1"))
	n := must(t)(moved.Rejoin("n2", 0))
	if n.Epoch != moved.Epoch+1 {
		t.Errorf("epoch %d, want %d", n.Epoch, moved.Epoch+1)
	}
	if got := names(n.Members); !slices.Equal(got, []string{"n1", "s1", "n3", "s2", "n4", "n2"}) {
		t.Errorf("members %v, want n2 last (the end of the spare FIFO)", got)
	}
	got, _ := n.Member("n2")
	want := Member{Name: "n2", Address: netip.MustParseAddrPort("10.0.0.2:7000"), Role: RoleSpare, State: StateAlive, Addrs: ips("10.0.0.2"), Incarnation: 1}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("rejoined n2 %+v, want %+v", got, want)
	}
	if got := names(n.Spares()); !slices.Equal(got, []string{"s2", "n2"}) {
		t.Errorf("spares %v, want s2 then n2", got)
	}
	if got := names(n.Ring()); !slices.Equal(got, []string{"n1", "s1", "n3", "n4"}) {
		t.Errorf("ring %v", got)
	}
	if s, _ := n.Member("s1"); s.Replaces != "n2" || s.ReplacesIncarnation != 0 {
		t.Errorf("s1 %+v: still replaces incarnation 0 of n2", s)
	}
	if o, ok := n.Owner(netip.MustParseAddr("10.0.0.2")); !ok || o != "n2" {
		t.Errorf("owner of n2's address %q %v, want n2", o, ok)
	}
	// The rejoined spare takes a failed node's place like any spare; the view it leads to stays valid.
	again := must(t)(n.ReplaceKeepingAddrs("s1", "n2"))
	if m, _ := again.Member("n2"); m.Role != RoleNode || m.Replaces != "s1" || m.Incarnation != 1 {
		t.Errorf("n2 after replacing s1: %+v", m)
	}
	// ... and fails and rejoins again, as incarnation 2.
	third := must(t)(must(t)(again.ReplaceKeepingAddrs("n2", "s2")).Rejoin("n2", 1))
	if m, _ := third.Member("n2"); m.Incarnation != 2 || m.Role != RoleSpare || m.Replaces != "" {
		t.Errorf("n2 rejoined twice: %+v", m)
	}

	took := must(t)(base.Replace("n2", "s1"))    // without job addresses: s1 holds n2's host address
	absorbed := must(t)(base.Absorb("n2", "n3")) // basic mode: n3 holds n2's host address
	two := must(t)(New([]Member{node("n1", "10.0.0.1:7000"), node("n2", "10.0.0.2:7000")}))
	twoMoved := must(t)(must(t)(two.AddSpare(spareM("s1", "10.0.0.11:7000"))).ReplaceKeepingAddrs("n2", "s1"))
	twoRejoined := must(t)(twoMoved.Rejoin("n2", 0))
	for _, tc := range []struct {
		name string
		v    View
		who  string
		inc  uint64
		err  string
	}{
		{"alive member", base, "n2", 0, "only a failed member rejoins"},
		{"unknown", moved, "zz", 0, "not a member"},
		{"already rejoined (a retried request)", n, "n2", 0, "only a failed member rejoins"},
		{"wrong incarnation", moved, "n2", 1, "failed as incarnation 0"},
		{"its address moved with its jobs", took, "n2", 0, "held by s1"},
		{"epoch overflow", View{Epoch: math.MaxUint64, Members: moved.Members}, "n2", 0, "epoch overflow"},
		{"absorbed in basic mode: the absorber holds its address", absorbed, "n2", 0, "held by n3"},
		{"the replacement failed with nobody in its place", must(t)(twoRejoined.Fail("s1")), "s1", 0, "at least 2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.v.Rejoin(tc.who, tc.inc); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want one containing %q", err, tc.err)
			}
		})
	}
}

// TestReplaceKeepingAddrs: with job addresses, the failed node's host address goes to nobody, and its
// replacement still stands for it.
func TestReplaceKeepingAddrs(t *testing.T) {
	base := cluster(t)
	for _, tc := range []struct {
		name string
		v    View
		by   string
	}{
		{"replace", must(t)(base.ReplaceKeepingAddrs("n2", "s1")), "s1"},
		{"a replacement replaced in turn", must(t)(must(t)(base.ReplaceKeepingAddrs("n2", "s1")).ReplaceKeepingAddrs("s1", "s2")), "s2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if o, ok := tc.v.Owner(netip.MustParseAddr("10.0.0.2")); ok {
				t.Errorf("n2's host address is held by %s", o)
			}
			for _, m := range tc.v.Members {
				if m.State == StateAlive && len(m.Addrs) != 1 {
					t.Errorf("%s holds %v, want its own address only", m.Name, m.Addrs)
				}
			}
			if s, ok := tc.v.Standing("n2"); !ok || s.Name != tc.by {
				t.Errorf("Standing(n2) = %s %v, want %s", s.Name, ok, tc.by)
			}
		})
	}
}

// TestStandingAcrossRejoin: a run placed before a member failed keeps meaning that member's replacement
// after the member rejoined; once the replacement is gone, the rejoined member stands for itself.
func TestStandingAcrossRejoin(t *testing.T) {
	base := cluster(t)
	moved := must(t)(base.ReplaceKeepingAddrs("n2", "s1"))
	rejoined := must(t)(moved.Rejoin("n2", 0))
	back := must(t)(rejoined.ReplaceKeepingAddrs("s1", "n2")) // s1 failed; n2 took its place (and n2's old part)
	replacementFailed := must(t)(rejoined.Fail("s1"))
	for _, tc := range []struct {
		name string
		v    View
		host string
		want string // "" for none
	}{
		{"before the rejoin: the replacement", moved, "n2", "s1"},
		{"after the rejoin: still the replacement", rejoined, "n2", "s1"},
		{"the replacement stands for its own name", rejoined, "s1", "s1"},
		{"the replacement failed, n2 replaced it: n2", back, "n2", "n2"},
		{"s1's name now means n2", back, "s1", "n2"},
		{"the replacement failed with nobody in its place: n2 itself", replacementFailed, "n2", "n2"},
		{"a member never failed", rejoined, "n3", "n3"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := tc.v.Standing(tc.host)
			if tc.want == "" {
				if ok {
					t.Fatalf("Standing(%s) = %s, want none", tc.host, got.Name)
				}
				return
			}
			if !ok || got.Name != tc.want {
				t.Fatalf("Standing(%s) = %q %v, want %s", tc.host, got.Name, ok, tc.want)
			}
		})
	}
	if p, ok := rejoined.RunProtector([]string{"n1", "n2"}, "n1"); !ok || p.Name != "s1" {
		t.Errorf("run protector of n1 in a run placed on n1, n2 before n2 rejoined: %s %v, want s1", p.Name, ok)
	}
}

// TestDecodeIncarnations: the incarnation links a received view may carry are checked like the others.
func TestDecodeIncarnations(t *testing.T) {
	const ok = `{"epoch":5,"members":[` +
		`{"name":"a","address":"10.0.0.1:1","role":"node","state":"alive","addrs":["10.0.0.1"]},` +
		`{"name":"b","address":"10.0.0.2:1","role":"node","state":"alive","addrs":["10.0.0.2"],"replaces":"c"},` +
		`{"name":"d","address":"10.0.0.4:1","role":"node","state":"alive","addrs":["10.0.0.4"]},` +
		`{"name":"c","address":"10.0.0.3:1","role":"spare","state":"alive","addrs":["10.0.0.3"],"incarnation":1}]}`
	if _, err := Decode([]byte(ok)); err != nil {
		t.Fatalf("valid view refused: %v", err)
	}
	swap := func(old, new string) string { return strings.Replace(ok, old, new, 1) }
	for _, tc := range []struct {
		name, in, err string
	}{
		{"replaces a future incarnation", swap(`"replaces":"c"`, `"replaces":"c","replaces_incarnation":2`), "at incarnation 1"},
		{"replaces the current alive incarnation", swap(`"replaces":"c"`, `"replaces":"c","replaces_incarnation":1`), "not a failed node"},
		{"replaces incarnation of nobody", swap(`"replaces":"c"`, `"replaces_incarnation":1`), "of nobody"},
		{"two replace one incarnation", swap(`"addrs":["10.0.0.4"]`, `"addrs":["10.0.0.4"],"replaces":"c"`), "one failed node gets one spare"},
		{"negative incarnation", swap(`"incarnation":1`, `"incarnation":-1`), "cannot unmarshal"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Decode([]byte(tc.in)); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want one containing %q", err, tc.err)
			}
		})
	}
	// Two incarnations of one name each have their replacement.
	two := swap(`"addrs":["10.0.0.4"]`, `"addrs":["10.0.0.4"],"replaces":"c","replaces_incarnation":1`)
	two = strings.Replace(two, `"role":"spare","state":"alive","addrs":["10.0.0.3"],"incarnation":1`, `"role":"node","state":"failed","addrs":["10.0.0.3"],"incarnation":1`, 1)
	if _, err := Decode([]byte(two)); err != nil {
		t.Errorf("a replacement per incarnation refused: %v", err)
	}
}
