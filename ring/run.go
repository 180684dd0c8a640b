package ring

// A run (a Slurm allocation, a hostfile) names its own hosts; the view says who stands for each of them
// now. Detection stays on the cluster ring; these resolve a run's hosts through it.

// Standing returns the alive member that stands for name now: name itself while it is alive; once it
// failed, the member that replaced it (Replace: Replaces names it) or that holds its host address (Absorb,
// or a later replacement of that member, which took the address along). False if name is not a member, or
// failed with nobody in its place.
func (v View) Standing(name string) (Member, bool) {
	i := v.index(name)
	if i < 0 {
		return Member{}, false
	}
	m := v.Members[i]
	if m.State == StateAlive {
		return cloneMember(m), true
	}
	for _, r := range v.Members {
		if r.Replaces == name && r.State == StateAlive {
			return cloneMember(r), true
		}
	}
	if m.Address.IsValid() {
		if owner, ok := v.Owner(m.Address.Addr()); ok {
			return v.Member(owner)
		}
	}
	return Member{}, false
}

// RunProtector returns the member that protects the part of a run running on member self, the run's parts
// running on hosts (in order): the member standing for the next host after self's own (cyclic), skipping
// hosts nobody stands for and hosts self stands for (it absorbed them). Self's own host is the first one
// self stands for; if it stands for none, the hosts are tried from the first. False if no other member
// stands for any of them: the caller falls back to the ring's protector.
func (v View) RunProtector(hosts []string, self string) (Member, bool) {
	n := len(hosts)
	pos := -1
	for i, h := range hosts {
		if s, ok := v.Standing(h); ok && s.Name == self {
			pos = i
			break
		}
	}
	for k := 1; k <= n; k++ {
		if s, ok := v.Standing(hosts[(pos+k+n)%n]); ok && s.Name != self {
			return s, true
		}
	}
	return Member{}, false
}
