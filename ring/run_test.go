package ring

import "testing"

// TestRunProtector: a run's protector is the member standing for the next host of the run after the
// part's own, through replacements, absorptions and failures, and nothing once no other host is alive.
func TestRunProtector(t *testing.T) {
	base := cluster(t)                             // nodes n1..n4 in ring order, spares s1, s2
	replaced := must(t)(base.Replace("n2", "s1"))  // s1 stands for n2
	absorbed := must(t)(base.Absorb("n2", "n4"))   // n4 holds n2's address
	failed := must(t)(base.Fail("n2"))             // nobody stands for n2
	twice := must(t)(replaced.Replace("s1", "s2")) // s1 (for n2) failed too, s2 took both
	allButN1 := must(t)(must(t)(base.Fail("n2")).Fail("n3"))
	tests := []struct {
		name  string
		v     View
		hosts []string
		self  string
		want  string // "" for none
	}{
		{"next host of the run, not the ring successor", base, []string{"n1", "n3"}, "n1", "n3"},
		{"cyclic", base, []string{"n1", "n3"}, "n3", "n1"},
		{"three hosts", base, []string{"n4", "n1", "n2"}, "n1", "n2"},
		{"a replaced host means its spare", replaced, []string{"n1", "n2"}, "n1", "s1"},
		{"the spare that replaced a host protects through the run's order", replaced, []string{"n1", "n2", "n3"}, "s1", "n3"},
		{"an absorbed host means the member holding its address", absorbed, []string{"n1", "n2", "n3"}, "n1", "n4"},
		{"the absorbing member is skipped as its own protector", absorbed, []string{"n2", "n4", "n1"}, "n4", "n1"},
		{"a failed host nobody replaced is skipped", failed, []string{"n1", "n2", "n3"}, "n1", "n3"},
		{"replaced twice: the newest stand-in", twice, []string{"n1", "n2"}, "n1", "s2"},
		{"every other host failed", allButN1, []string{"n1", "n2", "n3"}, "n1", ""},
		{"the only host is self", base, []string{"n1"}, "n1", ""},
		{"self not a host of the run: the first alive one", base, []string{"n3", "n4"}, "n1", "n3"},
		{"unknown hosts are skipped", base, []string{"n1", "nope", "n4"}, "n1", "n4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := tt.v.RunProtector(tt.hosts, tt.self)
			if tt.want == "" {
				if ok {
					t.Fatalf("protector %s, want none", got.Name)
				}
				return
			}
			if !ok || got.Name != tt.want {
				t.Fatalf("protector %q (%v), want %q", got.Name, ok, tt.want)
			}
		})
	}
}

func TestStanding(t *testing.T) {
	base := cluster(t)
	tests := []struct {
		name string
		v    View
		host string
		want string
	}{
		{"alive", base, "n2", "n2"},
		{"replaced", must(t)(base.Replace("n2", "s1")), "n2", "s1"},
		{"absorbed", must(t)(base.Absorb("n2", "n1")), "n2", "n1"},
		{"failed, nobody in its place", must(t)(base.Fail("n2")), "n2", ""},
		{"not a member", base, "n9", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := tt.v.Standing(tt.host)
			if (tt.want == "") == ok || got.Name != tt.want {
				t.Fatalf("Standing(%s) = %q, %v; want %q", tt.host, got.Name, ok, tt.want)
			}
		})
	}
}
