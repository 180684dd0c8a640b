package ring

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

func node(name, addr string) Member {
	return Member{Name: name, Address: netip.MustParseAddrPort(addr), Role: RoleNode}
}

func spareM(name, addr string) Member {
	return Member{Name: name, Address: netip.MustParseAddrPort(addr), Role: RoleSpare}
}

func ips(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

func names(ms []Member) []string {
	out := []string{}
	for _, m := range ms {
		out = append(out, m.Name)
	}
	return out
}

// cluster is n1..n4 (nodes) and s1, s2 (spares), interleaved in the configuration on purpose.
func cluster(t testing.TB) View {
	t.Helper()
	v, err := New([]Member{
		node("n1", "10.0.0.1:7000"),
		spareM("s1", "10.0.0.11:7000"),
		node("n2", "10.0.0.2:7000"),
		node("n3", "10.0.0.3:7000"),
		spareM("s2", "10.0.0.12:7000"),
		node("n4", "10.0.0.4:7000"),
	})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// must(t)(v, err) fails the test on err.
func must(t testing.TB) func(View, error) View {
	return func(v View, err error) View {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

func TestNew(t *testing.T) {
	for _, tc := range []struct {
		name    string
		members []Member
		err     string // substring; "" means success
	}{
		{"two nodes", []Member{node("a", "10.0.0.1:1"), node("b", "10.0.0.2:1")}, ""},
		{"explicit addrs kept", []Member{{Name: "a", Address: netip.MustParseAddrPort("10.0.0.1:1"), Role: RoleNode, Addrs: ips("10.0.1.1", "10.0.1.2")}, node("b", "10.0.0.2:1")}, ""},
		{"same ip other port", []Member{node("a", "10.0.0.1:1"), node("b", "10.0.0.1:2")}, "held by both"},
		{"one node", []Member{node("a", "10.0.0.1:1"), spareM("s", "10.0.0.2:1")}, "at least 2"},
		{"no members", nil, "at least 2"},
		{"duplicate name", []Member{node("a", "10.0.0.1:1"), node("a", "10.0.0.2:1"), node("b", "10.0.0.3:1")}, "appears twice"},
		{"duplicate address", []Member{node("a", "10.0.0.1:1"), node("b", "10.0.0.1:1")}, "also \"a\"'s"},
		{"duplicate address v4-in-v6", []Member{node("a", "10.0.0.1:1"), node("b", "[::ffff:10.0.0.1]:1")}, "also \"a\"'s"},
		{"bad role", []Member{node("a", "10.0.0.1:1"), node("b", "10.0.0.2:1"), {Name: "c", Address: netip.MustParseAddrPort("10.0.0.3:1"), Role: "boss"}}, "role \"boss\""},
		{"empty role", []Member{node("a", "10.0.0.1:1"), node("b", "10.0.0.2:1"), {Name: "c", Address: netip.MustParseAddrPort("10.0.0.3:1")}}, "role \"\""},
		{"failed member", []Member{node("a", "10.0.0.1:1"), node("b", "10.0.0.2:1"), {Name: "c", Address: netip.MustParseAddrPort("10.0.0.3:1"), Role: RoleNode, State: StateFailed}}, "every member alive"},
		{"no address", []Member{node("a", "10.0.0.1:1"), {Name: "b", Role: RoleNode}}, "must be ip:port"},
		{"port 0", []Member{node("a", "10.0.0.1:1"), node("b", "10.0.0.2:0")}, "must be ip:port"},
		{"empty name", []Member{node("a", "10.0.0.1:1"), node("", "10.0.0.2:1")}, "empty"},
		{"name with slash", []Member{node("a", "10.0.0.1:1"), node("b/c", "10.0.0.2:1")}, "may only contain"},
		{"name is an ip", []Member{node("a", "10.0.0.1:1"), node("10.0.0.2", "10.0.0.2:1")}, "is an IP address"},
		{"explicit addrs clash", []Member{{Name: "a", Address: netip.MustParseAddrPort("10.0.0.1:1"), Role: RoleNode, Addrs: ips("10.0.0.1", "10.0.0.2")}, node("b", "10.0.0.2:1")}, "held by both"},
		{"unspecified addr", []Member{{Name: "a", Address: netip.MustParseAddrPort("10.0.0.1:1"), Role: RoleNode, Addrs: ips("0.0.0.0")}, node("b", "10.0.0.2:1")}, "not a usable"},
		{"replaces in a new view", []Member{node("a", "10.0.0.1:1"), {Name: "b", Address: netip.MustParseAddrPort("10.0.0.2:1"), Role: RoleNode, Replaces: "a"}}, "not a failed node"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := cloneMembers(tc.members)
			v, err := New(tc.members)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("New: err %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if v.Epoch != 1 {
				t.Errorf("epoch %d, want 1", v.Epoch)
			}
			for i, m := range v.Members {
				if m.State != StateAlive {
					t.Errorf("%s: state %q", m.Name, m.State)
				}
				want := in[i].Addrs
				if len(want) == 0 {
					want = []netip.Addr{in[i].Address.Addr()}
				}
				if !slices.Equal(m.Addrs, want) {
					t.Errorf("%s: addrs %v, want %v", m.Name, m.Addrs, want)
				}
			}
			if !reflect.DeepEqual(tc.members, in) {
				t.Errorf("New modified its argument: %v", tc.members)
			}
		})
	}
}

func TestNewDoesNotAlias(t *testing.T) {
	in := []Member{node("a", "10.0.0.1:1"), {Name: "b", Address: netip.MustParseAddrPort("10.0.0.2:1"), Role: RoleNode, Addrs: ips("10.0.0.2")}}
	v := must(t)(New(in))
	in[1].Addrs[0] = netip.MustParseAddr("10.9.9.9")
	in[0].Name = "zz"
	if v.Members[0].Name != "a" || v.Members[1].Addrs[0] != netip.MustParseAddr("10.0.0.2") {
		t.Fatalf("view shares memory with New's argument: %+v", v.Members)
	}
	m, _ := v.Member("b")
	m.Addrs[0] = netip.MustParseAddr("10.9.9.9")
	if v.Members[1].Addrs[0] != netip.MustParseAddr("10.0.0.2") {
		t.Fatal("Member returned a slice shared with the view")
	}
	if m, ok := v.Member("zz"); ok || m.Name != "" {
		t.Fatalf("Member of an unknown name: %+v %v", m, ok)
	}
}

// replaced is cluster with n2 replaced by s1, n4 absorbed by n1 (basic mode) and s2 failed.
func replaced(t *testing.T) View {
	v := cluster(t)
	v = must(t)(v.Replace("n2", "s1"))
	v = must(t)(v.Absorb("n4", "n1"))
	return must(t)(v.Fail("s2"))
}

func TestQueries(t *testing.T) {
	base := cluster(t)
	after := replaced(t)
	two := must(t)(New([]Member{node("a", "10.0.0.1:1"), node("b", "10.0.0.2:1")}))
	lone := must(t)(two.Absorb("b", "a"))
	for _, tc := range []struct {
		name      string
		v         View
		ring      []string
		spares    []string
		protector map[string]string // name -> protector ("" means none)
		pred      map[string]string // name -> predecessor ("" means none)
	}{
		{
			name: "initial", v: base,
			ring: []string{"n1", "n2", "n3", "n4"}, spares: []string{"s1", "s2"},
			protector: map[string]string{"n1": "n2", "n2": "n3", "n3": "n4", "n4": "n1", "s1": "", "nobody": ""},
			pred:      map[string]string{"n1": "n4", "n2": "n1", "n3": "n2", "n4": "n3", "s1": "", "nobody": ""},
		},
		{
			// s1 sits where n2 was (before it); n4's position still names n1 as its protector.
			name: "after replace, absorb and fail", v: after,
			ring: []string{"n1", "s1", "n3"}, spares: []string{},
			protector: map[string]string{"n1": "s1", "s1": "n3", "n2": "n3", "n3": "n1", "n4": "n1", "s2": ""},
			pred:      map[string]string{"n1": "n3", "s1": "n1", "n3": "s1", "n2": "", "n4": "", "s2": ""},
		},
		{
			name: "two nodes", v: two,
			ring: []string{"a", "b"}, spares: []string{},
			protector: map[string]string{"a": "b", "b": "a"},
			pred:      map[string]string{"a": "b", "b": "a"},
		},
		{
			name: "one alive node", v: lone,
			ring: []string{"a"}, spares: []string{},
			protector: map[string]string{"a": "", "b": "a"},
			pred:      map[string]string{"a": "", "b": ""},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := names(tc.v.Ring()); !slices.Equal(got, tc.ring) {
				t.Errorf("Ring %v, want %v", got, tc.ring)
			}
			if got := names(tc.v.Spares()); !slices.Equal(got, tc.spares) {
				t.Errorf("Spares %v, want %v", got, tc.spares)
			}
			for n, want := range tc.protector {
				p, ok := tc.v.Protector(n)
				if ok != (want != "") || p.Name != want {
					t.Errorf("Protector(%s) = %q %v, want %q", n, p.Name, ok, want)
				}
			}
			for n, want := range tc.pred {
				p, ok := tc.v.Predecessor(n)
				if ok != (want != "") || p.Name != want {
					t.Errorf("Predecessor(%s) = %q %v, want %q", n, p.Name, ok, want)
				}
			}
			// Predecessor is the inverse of Protector on the ring, by its definition.
			for _, m := range tc.v.Ring() {
				p, ok := tc.v.Predecessor(m.Name)
				var want []string
				for _, x := range tc.v.Ring() {
					if q, ok := tc.v.Protector(x.Name); ok && q.Name == m.Name {
						want = append(want, x.Name)
					}
				}
				if ok && (len(want) != 1 || want[0] != p.Name) || !ok && len(want) != 0 {
					t.Errorf("Predecessor(%s) = %q %v, but the nodes protected by it are %v", m.Name, p.Name, ok, want)
				}
			}
		})
	}
}

func TestOwner(t *testing.T) {
	v := replaced(t)
	for _, tc := range []struct {
		ip, owner string
	}{
		{"10.0.0.1", "n1"},
		{"10.0.0.4", "n1"}, // absorbed from n4
		{"10.0.0.2", "s1"}, // taken over from n2
		{"10.0.0.11", "s1"},
		{"::ffff:10.0.0.2", "s1"},
		{"10.0.0.12", ""}, // s2 failed: nobody owns its address
		{"10.0.0.99", ""},
	} {
		got, ok := v.Owner(netip.MustParseAddr(tc.ip))
		if ok != (tc.owner != "") || got != tc.owner {
			t.Errorf("Owner(%s) = %q %v, want %q", tc.ip, got, ok, tc.owner)
		}
	}
}

func TestReplace(t *testing.T) {
	v := cluster(t)
	before, _ := Encode(v)
	n := must(t)(v.Replace("n2", "s1"))
	if after, _ := Encode(v); string(after) != string(before) {
		t.Fatal("Replace modified the view it was called on")
	}
	if n.Epoch != v.Epoch+1 {
		t.Errorf("epoch %d, want %d", n.Epoch, v.Epoch+1)
	}
	if got := names(n.Members); !slices.Equal(got, []string{"n1", "s1", "n2", "n3", "s2", "n4"}) {
		t.Errorf("members %v", got)
	}
	s, _ := n.Member("s1")
	want := Member{Name: "s1", Address: netip.MustParseAddrPort("10.0.0.11:7000"), Role: RoleNode, State: StateAlive, Addrs: ips("10.0.0.11", "10.0.0.2"), Replaces: "n2"}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("spare after replace: %+v, want %+v", s, want)
	}
	if f, _ := n.Member("n2"); f.State != StateFailed {
		t.Errorf("n2 state %q", f.State)
	}
	// A chain: the replacing spare fails in turn and the next spare takes everything it held.
	n2 := must(t)(n.Replace("s1", "s2"))
	s2, _ := n2.Member("s2")
	if !slices.Equal(s2.Addrs, ips("10.0.0.12", "10.0.0.11", "10.0.0.2")) || s2.Replaces != "s1" {
		t.Errorf("second replacement %+v", s2)
	}
	if got := names(n2.Ring()); !slices.Equal(got, []string{"n1", "s2", "n3", "n4"}) {
		t.Errorf("ring %v", got)
	}

	for _, tc := range []struct {
		name          string
		v             View
		failed, spare string
		err           string
	}{
		{"failed unknown", v, "zz", "s1", "\"zz\" is not an alive node"},
		{"failed is a spare", v, "s2", "s1", "\"s2\" is not an alive node"},
		{"failed already failed", n, "n2", "s2", "\"n2\" is not an alive node"},
		{"spare unknown", v, "n2", "zz", "\"zz\" is not an alive spare"},
		{"spare is a node", v, "n2", "n3", "\"n3\" is not an alive spare"},
		{"spare already used", n, "n3", "s1", "\"s1\" is not an alive spare"},
		{"spare failed", must(t)(v.Fail("s1")), "n3", "s1", "\"s1\" is not an alive spare"},
		{"epoch overflow", View{Epoch: math.MaxUint64, Members: v.Members}, "n2", "s1", "epoch overflow"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.v.Replace(tc.failed, tc.spare); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want one containing %q", err, tc.err)
			}
		})
	}
}

func TestAbsorb(t *testing.T) {
	v := cluster(t)
	n := must(t)(v.Absorb("n3", "n4"))
	if n.Epoch != 2 || v.Members[3].State != StateAlive {
		t.Fatalf("epoch %d, original n3 %q", n.Epoch, v.Members[3].State)
	}
	h, _ := n.Member("n4")
	if !slices.Equal(h.Addrs, ips("10.0.0.4", "10.0.0.3")) {
		t.Errorf("host addrs %v", h.Addrs)
	}
	if got := names(n.Ring()); !slices.Equal(got, []string{"n1", "n2", "n4"}) {
		t.Errorf("ring %v", got)
	}
	if p, _ := n.Protector("n3"); p.Name != "n4" {
		t.Errorf("failed n3's protector %q, want n4", p.Name)
	}
	for _, tc := range []struct {
		name, failed, host, err string
	}{
		{"failed unknown", "zz", "n1", "\"zz\" is not an alive node"},
		{"failed already failed", "n3", "n1", "\"n3\" is not an alive node"},
		{"failed is a spare", "s1", "n1", "\"s1\" is not an alive node"},
		{"host is itself", "n1", "n1", "\"n1\" is not another alive node"},
		{"host failed", "n1", "n3", "\"n3\" is not another alive node"},
		{"host is a spare", "n1", "s1", "\"s1\" is not another alive node"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := n.Absorb(tc.failed, tc.host); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want one containing %q", err, tc.err)
			}
		})
	}
	if _, err := (View{Epoch: math.MaxUint64, Members: v.Members}).Absorb("n1", "n2"); err == nil {
		t.Error("absorb at the maximum epoch succeeded")
	}
}

func TestAddSpare(t *testing.T) {
	v := cluster(t)
	n := must(t)(v.AddSpare(Member{Name: "s3", Address: netip.MustParseAddrPort("10.0.0.13:7000")}))
	if n.Epoch != 2 || len(v.Members) != 6 {
		t.Fatalf("epoch %d, original has %d members", n.Epoch, len(v.Members))
	}
	if got := names(n.Spares()); !slices.Equal(got, []string{"s1", "s2", "s3"}) {
		t.Errorf("spares %v", got)
	}
	s, _ := n.Member("s3")
	if s.Role != RoleSpare || s.State != StateAlive || !slices.Equal(s.Addrs, ips("10.0.0.13")) {
		t.Errorf("new spare %+v", s)
	}
	failed := must(t)(v.Replace("n2", "s1"))
	for _, tc := range []struct {
		name string
		v    View
		m    Member
		err  string
	}{
		{"duplicate name", v, spareM("s1", "10.0.0.20:7000"), "appears twice"},
		{"name of a failed member", failed, spareM("n2", "10.0.0.20:7000"), "appears twice"},
		{"duplicate cluster address", v, spareM("s9", "10.0.0.11:7000"), "cluster address"},
		{"host address held", v, Member{Name: "s9", Address: netip.MustParseAddrPort("10.0.0.20:7000"), Addrs: ips("10.0.0.3")}, "held by both"},
		{"node role", v, node("s9", "10.0.0.20:7000"), "want spare"},
		{"failed state", v, Member{Name: "s9", Address: netip.MustParseAddrPort("10.0.0.20:7000"), State: StateFailed}, "want alive"},
		{"replaces", v, Member{Name: "s9", Address: netip.MustParseAddrPort("10.0.0.20:7000"), Replaces: "n1"}, "replaces nobody"},
		{"bad name", v, spareM("S 9", "10.0.0.20:7000"), "may only contain"},
		{"no address", v, Member{Name: "s9"}, "ip:port"},
		{"epoch overflow", View{Epoch: math.MaxUint64, Members: v.Members}, spareM("s9", "10.0.0.20:7000"), "epoch overflow"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.v.AddSpare(tc.m); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want one containing %q", err, tc.err)
			}
		})
	}
}

func TestFail(t *testing.T) {
	v := cluster(t)
	n := must(t)(v.Fail("s1"))
	if got := names(n.Spares()); !slices.Equal(got, []string{"s2"}) || n.Epoch != 2 {
		t.Errorf("spares %v epoch %d", got, n.Epoch)
	}
	n = must(t)(n.Fail("n3"))
	if _, ok := n.Owner(netip.MustParseAddr("10.0.0.3")); ok {
		t.Error("a failed node without replacement still owns its address")
	}
	two := must(t)(New([]Member{node("a", "10.0.0.1:1"), node("b", "10.0.0.2:1")}))
	one := must(t)(two.Fail("a"))
	for _, tc := range []struct {
		name string
		v    View
		fail string
		err  string
	}{
		{"unknown", v, "zz", "not an alive member"},
		{"already failed", n, "s1", "not an alive member"},
		{"last alive node", one, "b", "no node is alive"},
		{"epoch overflow", View{Epoch: math.MaxUint64, Members: v.Members}, "n1", "epoch overflow"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.v.Fail(tc.fail); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want one containing %q", err, tc.err)
			}
		})
	}
}

func TestNewer(t *testing.T) {
	v := cluster(t)
	a := must(t)(v.Replace("n2", "s1"))
	b := must(t)(v.Replace("n3", "s1")) // a concurrent, conflicting decision at the same epoch
	bad := a
	bad.Members = cloneMembers(a.Members)
	bad.Members[0].Role = "boss"
	bad.Epoch = 99
	for _, tc := range []struct {
		name string
		a, b View
		want bool
	}{
		{"higher epoch", v, a, true},
		{"lower epoch", a, v, false},
		{"same view", a, a, false},
		{"equal copies", a, must(t)(v.Replace("n2", "s1")), false},
		{"from zero view", View{}, v, true},
		{"inconsistent b", a, bad, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Newer(tc.a, tc.b); got != tc.want {
				t.Errorf("Newer = %v, want %v", got, tc.want)
			}
		})
	}
	// Same epoch, different content: exactly one direction wins, so agents holding either converge.
	if Newer(a, b) == Newer(b, a) {
		t.Errorf("tie-break is not antisymmetric: Newer(a,b)=%v Newer(b,a)=%v", Newer(a, b), Newer(b, a))
	}
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	for _, v := range []View{cluster(t), replaced(t)} {
		b, err := Encode(v)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Decode(b)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, v) {
			t.Errorf("round trip:\n got %+v\nwant %+v", got, v)
		}
	}
	if _, err := Encode(View{}); err == nil {
		t.Error("encoding an empty view succeeded")
	}
}

func TestDecodeRefuses(t *testing.T) {
	const ok = `{"epoch":3,"members":[` +
		`{"name":"a","address":"10.0.0.1:1","role":"node","state":"alive","addrs":["10.0.0.1","10.0.0.3"]},` +
		`{"name":"b","address":"10.0.0.2:1","role":"node","state":"alive","addrs":["10.0.0.2"]},` +
		`{"name":"c","address":"10.0.0.3:1","role":"node","state":"failed","addrs":["10.0.0.3"]}]}`
	if v, err := Decode([]byte(ok + "\n")); err != nil || v.Epoch != 3 || len(v.Members) != 3 {
		t.Fatalf("valid view refused: %v", err)
	}
	swap := func(old, new string) string { return strings.Replace(ok, old, new, 1) }
	for _, tc := range []struct {
		name, in, err string
	}{
		{"empty", ``, "EOF"},
		{"not json", `epoch=3`, "invalid character"},
		{"trailing data", ok + `{}`, "trailing data"},
		{"unknown field", swap(`"epoch":3`, `"epoch":3,"leader":"a"`), "unknown field"},
		{"epoch 0", swap(`"epoch":3`, `"epoch":0`), "epoch 0"},
		{"negative epoch", swap(`"epoch":3`, `"epoch":-1`), "cannot unmarshal"},
		{"bad address", swap(`"10.0.0.2:1"`, `"nowhere"`), "ip:port"},
		{"bad host addr", swap(`["10.0.0.2"]`, `["10.0.0.256"]`), "10.0.0.256"},
		{"empty address", swap(`"10.0.0.2:1"`, `""`), "must be ip:port"},
		{"bad state", swap(`"state":"failed"`, `"state":"zombie"`), "state \"zombie\""},
		{"missing state", swap(`,"state":"failed"`, ``), "state \"\""},
		{"alive without addrs", swap(`,"addrs":["10.0.0.2"]`, ``), "holds no host address"},
		{"address held twice", swap(`["10.0.0.2"]`, `["10.0.0.2","10.0.0.1"]`), "held by both"},
		{"address listed twice", swap(`["10.0.0.2"]`, `["10.0.0.2","10.0.0.2"]`), "twice"},
		{"failed members only", swap(`"name":"b","address":"10.0.0.2:1","role":"node","state":"alive"`, `"name":"b","address":"10.0.0.2:1","role":"node","state":"failed"`), ""},
		{"no alive node", strings.ReplaceAll(ok, `"alive"`, `"failed"`), "no node is alive"},
		{"replaces unknown", swap(`"state":"alive","addrs":["10.0.0.2"]`, `"state":"alive","addrs":["10.0.0.2"],"replaces":"zz"`), "not a member"},
		{"replaces alive", swap(`"state":"alive","addrs":["10.0.0.2"]`, `"state":"alive","addrs":["10.0.0.2"],"replaces":"a"`), "not a failed node"},
		{"replaces itself", swap(`"state":"alive","addrs":["10.0.0.2"]`, `"state":"alive","addrs":["10.0.0.2"],"replaces":"b"`), "replaces itself"},
		{"replaced twice", strings.Replace(swap(`"state":"alive","addrs":["10.0.0.2"]`, `"state":"alive","addrs":["10.0.0.2"],"replaces":"c"`),
			`"addrs":["10.0.0.1","10.0.0.3"]`, `"addrs":["10.0.0.1","10.0.0.3"],"replaces":"c"`, 1), "one failed node gets one spare"},
		{"spare replaces", swap(`"role":"node","state":"alive","addrs":["10.0.0.2"]`, `"role":"spare","state":"alive","addrs":["10.0.0.2"],"replaces":"c"`), "is a spare"},
		{"too large", ok + strings.Repeat(" ", MaxEncoded), "more than"},
		{"null members", `{"epoch":1,"members":null}`, "at least 2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode([]byte(tc.in))
			if tc.err == "" { // a view with failed and alive nodes only is fine
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want one containing %q", err, tc.err)
			}
		})
	}
}

func TestSaveLoad(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "view.json")
	if _, err := Load(p); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Load of a missing file: %v, want fs.ErrNotExist", err)
	}
	v := replaced(t)
	if err := Save(p, v); err != nil {
		t.Fatal(err)
	}
	got, err := Load(p)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, v) {
		t.Errorf("loaded %+v, want %+v", got, v)
	}
	// An inconsistent view is not saved and the saved one survives.
	if err := Save(p, View{Epoch: 9}); err == nil {
		t.Fatal("saving an inconsistent view succeeded")
	}
	if got, err := Load(p); err != nil || got.Epoch != v.Epoch {
		t.Fatalf("after refused save: %v %v", got.Epoch, err)
	}
	if err := Save(filepath.Join(dir, "missing", "view.json"), v); err == nil {
		t.Error("save into a missing directory succeeded")
	}
	if err := os.WriteFile(p, []byte(`{"epoch":`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(p); err == nil || !strings.Contains(err.Error(), p) {
		t.Errorf("Load of a torn file: %v, want an error naming the file", err)
	}
}

func FuzzDecode(f *testing.F) {
	v := cluster(f)
	rejoined := must(f)(must(f)(v.ReplaceKeepingAddrs("n2", "s1")).Rejoin("n2", 0))
	for _, w := range []View{v, must(f)(v.Replace("n2", "s1")), must(f)(v.Absorb("n4", "n1")), rejoined, must(f)(rejoined.Replace("s1", "n2"))} {
		b, _ := Encode(w)
		f.Add(b)
	}
	f.Add([]byte(`{"epoch":1,"members":[{"name":"a","address":"[::1]:1","role":"node","state":"alive","addrs":["::1"]},{"name":"b","address":"[fe80::1%eth0]:1","role":"node","state":"failed"}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := Decode(b)
		if err != nil {
			return
		}
		// What Decode accepts must be consistent enough to re-encode identically and to answer queries.
		e, err := Encode(v)
		if err != nil {
			t.Fatalf("decoded view does not encode: %v", err)
		}
		w, err := Decode(e)
		if err != nil || !reflect.DeepEqual(v, w) {
			t.Fatalf("re-decode: %v, %+v != %+v", err, w, v)
		}
		if Newer(v, w) || Newer(w, v) {
			t.Fatal("a view is newer than itself")
		}
		if len(v.Ring()) == 0 {
			t.Fatal("accepted a view with no alive node")
		}
		owners := map[netip.Addr]string{}
		for _, m := range v.Members {
			p, ok := v.Protector(m.Name)
			if ok && !p.aliveNode() {
				t.Fatalf("protector of %s is %+v", m.Name, p)
			}
			if m.State != StateAlive {
				continue
			}
			for _, a := range m.Addrs {
				if o, ok := owners[a.Unmap()]; ok {
					t.Fatalf("%s held by %s and %s", a, o, m.Name)
				}
				owners[a.Unmap()] = m.Name
				if o, _ := v.Owner(a); o != m.Name {
					t.Fatalf("Owner(%s) = %s, want %s", a, o, m.Name)
				}
			}
		}
	})
}

// TestViewFitsWhatMembersAccept: no operation makes a view longer than Decode accepts, since every peer
// would refuse it while its maker went on with it.
func TestViewFitsWhatMembersAccept(t *testing.T) {
	v := cluster(t)
	// Spares until one more would not fit (each with its host address, as New fills it in).
	full := View{Epoch: v.Epoch, Members: slices.Clone(v.Members)}
	size := len(must(t)(full, nil).encoded(t))
	for i := 0; ; i++ {
		m := spareM(fmt.Sprintf("x%d", i), fmt.Sprintf("10.%d.%d.%d:7000", 100+i>>16, i>>8&0xff, i&0xff))
		m.State, m.Addrs = StateAlive, []netip.Addr{m.Address.Addr()}
		b, _ := json.Marshal(m)
		if size+len(b)+1 > MaxEncoded {
			break
		}
		size += len(b) + 1
		full.Members = append(full.Members, m)
	}
	if got := len(full.encoded(t)); got != size {
		t.Fatalf("encoded %d bytes, counted %d", got, size)
	}
	if _, err := Decode(full.encoded(t)); err != nil {
		t.Fatalf("a view of %d bytes (%d members) refused: %v", size, len(full.Members), err)
	}
	if _, err := New(full.Members); err != nil {
		t.Fatalf("New of %d members that fit: %v", len(full.Members), err)
	}
	one := spareM("s99", "10.0.0.99:7000")
	if _, err := full.AddSpare(one); err == nil || !strings.Contains(err.Error(), "more than the") {
		t.Errorf("a spare past the bound (%d members): err %v, want a refusal", len(full.Members)+1, err)
	}
	if _, err := New(append(slices.Clone(full.Members), one)); err == nil || !strings.Contains(err.Error(), "more than the") {
		t.Errorf("New past the bound: err %v, want a refusal", err)
	}
	if _, err := v.AddSpare(one); err != nil {
		t.Errorf("a spare within the bound: %v", err)
	}
}

func (v View) encoded(t testing.TB) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
