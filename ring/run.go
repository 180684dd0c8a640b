package ring

// A run (a Slurm allocation, a hostfile) names its own hosts; the view says who stands for each of them
// now. Detection stays on the cluster ring; these resolve a run's hosts through it.

// Standing returns the alive member that stands for name now: name itself while it is alive; once it
// failed, the member that replaced it (Replace: Replaces names it) or that holds its host address (Absorb,
// or a later replacement of that member, which took the address along). False if name is not a member, or
// failed with nobody in its place.
//
// A member that failed and rejoined (Rejoin, a higher Incarnation) came back as an idle spare: a run that
// names it was placed before it failed, and that run's part is with the replacement of the earlier
// incarnation, which stands for the name while it is alive. Once that replacement is gone too, the
// rejoined member stands for its own name (a later failure may have brought the part back to it).
func (v View) Standing(name string) (Member, bool) {
	return v.standing(name, len(v.Members))
}

// standing follows replacements that failed in turn (a chain is at most as long as the view; depth bounds
// it anyway, against a cycle of incarnations).
func (v View) standing(name string, depth int) (Member, bool) {
	i := v.index(name)
	if i < 0 || depth < 0 {
		return Member{}, false
	}
	m := v.Members[i]
	replacement := func(earlier bool) (Member, bool) {
		for _, r := range v.Members {
			if r.Replaces != name || (earlier && r.ReplacesIncarnation >= m.Incarnation) || (!earlier && r.ReplacesIncarnation != m.Incarnation) {
				continue
			}
			if r.State == StateAlive {
				return cloneMember(r), true
			}
			if s, ok := v.standing(r.Name, depth-1); ok && s.Name != name {
				return s, true
			}
		}
		return Member{}, false
	}
	if m.Incarnation > 0 {
		if r, ok := replacement(true); ok {
			return r, true
		}
	}
	if m.State == StateAlive {
		return cloneMember(m), true
	}
	if r, ok := replacement(false); ok {
		return r, true
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
