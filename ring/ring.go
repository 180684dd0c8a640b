// Package ring holds the cluster's membership view: which members are nodes (in protection-ring order),
// which are spares (in registration order), which failed, and which host addresses each alive member holds.
//
// RADIC keeps this as tables replicated among the protectors and updated on demand, never collectively:
// copies may be stale, so every change bumps an epoch and every agent adopts the newest view it sees
// (Newer), with a deterministic tie-break so that all agents converge on the same one. Every operation is
// pure: it returns a new View and never modifies the one it was called on.
package ring

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/netip"
	"os"
	"slices"

	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/clustertls"
)

// Role is what a member is for.
type Role string

const (
	RoleNode  Role = "node"  // runs jobs, protects its predecessor in the ring
	RoleSpare Role = "spare" // idle, waits to take a failed node's place
)

// State is whether a member is still part of the cluster. A failed member stays in the view so that a
// failed agent that comes back learns it was replaced, and so that a failed node's ring position still
// names the node that holds its replicas. Its name comes back only through Rejoin, as a new incarnation.
type State string

const (
	StateAlive  State = "alive"
	StateFailed State = "failed"
)

// MaxEncoded bounds an encoded view that Decode accepts: a view comes from another agent and must not
// make us allocate without bound. It holds tens of thousands of members; no operation makes a view
// longer (checked), since every peer would refuse it.
const MaxEncoded = 4 << 20

// Member is one host of the cluster.
type Member struct {
	Name    string         `json:"name"`
	Address netip.AddrPort `json:"address"` // the agent's cluster address
	Role    Role           `json:"role"`
	State   State          `json:"state"`
	// Addrs are the host addresses this member holds: its own (Address.Addr()) plus those taken over
	// from failed nodes, since restored jobs keep the addresses their peers know. A failed member keeps
	// the list it had when it failed, as a record; it owns none of them any more.
	Addrs []netip.Addr `json:"addrs,omitempty"`
	// Replaces is, for a spare that took a failed node's place, that node's name, and
	// ReplacesIncarnation the incarnation of it that failed (the name may have rejoined since).
	Replaces            string `json:"replaces,omitempty"`
	ReplacesIncarnation uint64 `json:"replaces_incarnation,omitempty"`
	// Incarnation counts the member's returns: 0 as configured or registered, +1 at each Rejoin of a
	// failed member. What referred to an earlier incarnation (a replacement, a run placed before, a
	// recovery of its jobs) keeps referring to that one.
	Incarnation uint64 `json:"incarnation,omitempty"`
}

// View is one version of the membership. Members lists nodes in ring order and spares in registration
// (FIFO) order; the two orders are independent (only the relative order within each role matters).
type View struct {
	Epoch   uint64   `json:"epoch"`
	Members []Member `json:"members"`
}

// New builds the first view (epoch 1) from the configured members. Every member must be alive; an empty
// State means alive and empty Addrs means just the member's own address.
func New(members []Member) (View, error) {
	v := View{Epoch: 1, Members: cloneMembers(members)}
	for i := range v.Members {
		m := &v.Members[i]
		if m.State == "" {
			m.State = StateAlive
		}
		if m.State != StateAlive {
			return View{}, fmt.Errorf("new view: member %q is %q: a new cluster starts with every member alive", m.Name, m.State)
		}
		if len(m.Addrs) == 0 && m.Address.IsValid() {
			m.Addrs = []netip.Addr{m.Address.Addr().Unmap()}
		}
	}
	if err := v.validate(); err != nil {
		return View{}, fmt.Errorf("new view: %w", err)
	}
	if err := v.fits(); err != nil {
		return View{}, fmt.Errorf("new view: %w", err)
	}
	return v, nil
}

// validate refuses views that no sequence of operations on a valid view can produce, so that a view
// received from a buggy or confused agent is never adopted.
func (v View) validate() error {
	if v.Epoch == 0 {
		return errors.New("epoch 0: views start at epoch 1")
	}
	var errs []error
	names := map[string]int{}
	addrs := map[netip.AddrPort]string{}
	owner := map[netip.Addr]string{}
	type incarnation struct {
		name string
		n    uint64
	}
	replaced := map[incarnation]string{}
	nodes, alive := 0, 0
	for i, m := range v.Members {
		if err := clustertls.ValidateMemberName(m.Name); err != nil {
			errs = append(errs, fmt.Errorf("member %d: %w", i+1, err))
			continue
		}
		if _, dup := names[m.Name]; dup {
			errs = append(errs, fmt.Errorf("member %q appears twice", m.Name))
			continue
		}
		names[m.Name] = i
		if !m.Address.IsValid() || m.Address.Port() == 0 || !m.Address.Addr().IsValid() {
			errs = append(errs, fmt.Errorf("member %q: cluster address %q must be ip:port", m.Name, m.Address))
		} else {
			ap := netip.AddrPortFrom(m.Address.Addr().Unmap(), m.Address.Port())
			if other, dup := addrs[ap]; dup {
				errs = append(errs, fmt.Errorf("member %q: cluster address %s is also %q's", m.Name, m.Address, other))
			}
			addrs[ap] = m.Name
		}
		switch m.Role {
		case RoleNode:
			nodes++
		case RoleSpare:
		default:
			errs = append(errs, fmt.Errorf("member %q: role %q: use %s or %s", m.Name, m.Role, RoleNode, RoleSpare))
		}
		switch m.State {
		case StateAlive:
			if m.Role == RoleNode {
				alive++
			}
			if len(m.Addrs) == 0 {
				errs = append(errs, fmt.Errorf("member %q is alive but holds no host address", m.Name))
			}
		case StateFailed:
		default:
			errs = append(errs, fmt.Errorf("member %q: state %q: use %s or %s", m.Name, m.State, StateAlive, StateFailed))
		}
		seen := map[netip.Addr]bool{}
		for _, a := range m.Addrs {
			a = a.Unmap()
			if !a.IsValid() || a.IsUnspecified() {
				errs = append(errs, fmt.Errorf("member %q: host address %q is not a usable IP address", m.Name, a))
				continue
			}
			if seen[a] {
				errs = append(errs, fmt.Errorf("member %q lists host address %s twice", m.Name, a))
			}
			seen[a] = true
			if m.State != StateAlive {
				continue
			}
			if other, dup := owner[a]; dup && other != m.Name {
				errs = append(errs, fmt.Errorf("host address %s is held by both %q and %q", a, other, m.Name))
			}
			owner[a] = m.Name
		}
		switch {
		case m.Replaces != "":
			if m.Role != RoleNode {
				errs = append(errs, fmt.Errorf("member %q replaces %q but is a %s: only a spare that became a node replaces one", m.Name, m.Replaces, m.Role))
			}
			key := incarnation{m.Replaces, m.ReplacesIncarnation}
			if other, dup := replaced[key]; dup {
				errs = append(errs, fmt.Errorf("both %q and %q replace incarnation %d of %q: one failed node gets one spare", other, m.Name, key.n, m.Replaces))
			}
			replaced[key] = m.Name
		case m.ReplacesIncarnation != 0:
			errs = append(errs, fmt.Errorf("member %q replaces incarnation %d of nobody", m.Name, m.ReplacesIncarnation))
		}
	}
	for failed, by := range replaced {
		i, ok := names[failed.name]
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("member %q replaces %q, which is not a member", by, failed.name))
		case failed.name == by:
			errs = append(errs, fmt.Errorf("member %q replaces itself", by))
		case v.Members[i].Incarnation > failed.n:
			// That incarnation failed and the member rejoined since: the replacement stands for the old one.
		case v.Members[i].Incarnation < failed.n:
			errs = append(errs, fmt.Errorf("member %q replaces incarnation %d of %q, which is at incarnation %d", by, failed.n, failed.name, v.Members[i].Incarnation))
		case v.Members[i].Role != RoleNode || v.Members[i].State != StateFailed:
			errs = append(errs, fmt.Errorf("member %q replaces %q, which is not a failed node", by, failed.name))
		}
	}
	if nodes < 2 {
		errs = append(errs, fmt.Errorf("%d members with role node: a protection ring needs at least 2", nodes))
	}
	if nodes >= 2 && alive == 0 {
		errs = append(errs, errors.New("no node is alive"))
	}
	return errors.Join(errs...)
}

// Member returns the member with this name, alive or failed.
func (v View) Member(name string) (Member, bool) {
	if i := v.index(name); i >= 0 {
		return cloneMember(v.Members[i]), true
	}
	return Member{}, false
}

func (v View) index(name string) int {
	return slices.IndexFunc(v.Members, func(m Member) bool { return m.Name == name })
}

func (m Member) aliveNode() bool  { return m.Role == RoleNode && m.State == StateAlive }
func (m Member) aliveSpare() bool { return m.Role == RoleSpare && m.State == StateAlive }

// Ring returns the alive nodes in ring order.
func (v View) Ring() []Member {
	var out []Member
	for _, m := range v.Members {
		if m.aliveNode() {
			out = append(out, cloneMember(m))
		}
	}
	return out
}

// nodes returns the indices in Members of every node, alive or failed, in ring order, and the position of
// name among them (-1 if name is not a node).
func (v View) nodes(name string) (idx []int, pos int) {
	pos = -1
	for i, m := range v.Members {
		if m.Role == RoleNode {
			if m.Name == name {
				pos = len(idx)
			}
			idx = append(idx, i)
		}
	}
	return idx, pos
}

// Protector returns the node that keeps name's snapshots and logs (RADIC: the next logical node): the
// next alive node after name in ring order. A failed node keeps its ring position, so its protector is
// the node that held its replicas when it failed. It returns false if name is not a node or no other
// node is alive.
func (v View) Protector(name string) (Member, bool) {
	idx, pos := v.nodes(name)
	if pos < 0 {
		return Member{}, false
	}
	for k := 1; k < len(idx); k++ {
		if m := v.Members[idx[(pos+k)%len(idx)]]; m.aliveNode() {
			return cloneMember(m), true
		}
	}
	return Member{}, false
}

// Predecessor returns the alive node whose protector is name: the node whose heartbeats name watches
// and whose replicas it holds. It returns false if name is not an alive node or is the only one.
func (v View) Predecessor(name string) (Member, bool) {
	idx, pos := v.nodes(name)
	if pos < 0 || !v.Members[idx[pos]].aliveNode() {
		return Member{}, false
	}
	for k := 1; k < len(idx); k++ {
		if m := v.Members[idx[(pos-k+len(idx))%len(idx)]]; m.aliveNode() {
			return cloneMember(m), true
		}
	}
	return Member{}, false
}

// Owner returns the alive member that holds host address ip now. Failed members own nothing: their
// addresses moved with their jobs, or are gone with them.
func (v View) Owner(ip netip.Addr) (string, bool) {
	ip = ip.Unmap()
	for _, m := range v.Members {
		if m.State != StateAlive {
			continue
		}
		for _, a := range m.Addrs {
			if a.Unmap() == ip {
				return m.Name, true
			}
		}
	}
	return "", false
}

// Spares returns the alive spares in registration order: RADIC claims spares first-come-first-served.
func (v View) Spares() []Member {
	var out []Member
	for _, m := range v.Members {
		if m.aliveSpare() {
			out = append(out, cloneMember(m))
		}
	}
	return out
}

// Replace is RADIC's resilient mode: spare becomes a node at failed's ring position and takes its host
// addresses (its restored jobs keep them); failed is marked failed.
//
// The spare is placed just before the failed node, so that the failed node's protector stays the node
// that holds its replicas, and the spare inherits that same protector: the snapshots of the restored
// jobs keep going where the replicas already are.
func (v View) Replace(failed, spare string) (View, error) {
	return v.replace(failed, spare, true)
}

// ReplaceKeepingAddrs is Replace for a failed node whose jobs have addresses of their own: spare takes
// its ring position, and the failed node's host addresses stay with nobody, so that the host can come
// back with them (Rejoin).
func (v View) ReplaceKeepingAddrs(failed, spare string) (View, error) {
	return v.replace(failed, spare, false)
}

func (v View) replace(failed, spare string, takeAddrs bool) (View, error) {
	fi, si := v.index(failed), v.index(spare)
	if fi < 0 || !v.Members[fi].aliveNode() {
		return View{}, fmt.Errorf("replace %q by %q: %q is not an alive node in view %d", failed, spare, failed, v.Epoch)
	}
	if si < 0 || !v.Members[si].aliveSpare() {
		return View{}, fmt.Errorf("replace %q by %q: %q is not an alive spare in view %d", failed, spare, spare, v.Epoch)
	}
	n, err := v.next()
	if err != nil {
		return View{}, fmt.Errorf("replace %q by %q: %w", failed, spare, err)
	}
	f := &n.Members[fi]
	s := n.Members[si]
	s.Role, s.Replaces, s.ReplacesIncarnation = RoleNode, failed, f.Incarnation
	if takeAddrs {
		s.Addrs = mergeAddrs(s.Addrs, f.Addrs)
	}
	f.State = StateFailed
	n.Members = slices.Delete(n.Members, si, si+1)
	fi = n.index(failed)
	n.Members = slices.Insert(n.Members, fi, s)
	return n.checked("replace %q by %q", failed, spare)
}

// Absorb is RADIC's basic mode, used when no spare is free: host, an alive node (normally failed's
// protector, where the replicas are), takes failed's host addresses and runs its jobs; failed is marked
// failed and leaves the ring, keeping its position for Protector.
func (v View) Absorb(failed, host string) (View, error) {
	fi, hi := v.index(failed), v.index(host)
	if fi < 0 || !v.Members[fi].aliveNode() {
		return View{}, fmt.Errorf("absorb %q into %q: %q is not an alive node in view %d", failed, host, failed, v.Epoch)
	}
	if hi < 0 || hi == fi || !v.Members[hi].aliveNode() {
		return View{}, fmt.Errorf("absorb %q into %q: %q is not another alive node in view %d", failed, host, host, v.Epoch)
	}
	n, err := v.next()
	if err != nil {
		return View{}, fmt.Errorf("absorb %q into %q: %w", failed, host, err)
	}
	n.Members[hi].Addrs = mergeAddrs(n.Members[hi].Addrs, n.Members[fi].Addrs)
	n.Members[fi].State = StateFailed
	return n.checked("absorb %q into %q", failed, host)
}

// AddSpare registers a spare while jobs run (RADIC allows adding spares at any time); it goes to the end
// of the FIFO. Empty Role and State mean spare and alive; empty Addrs means its own address.
func (v View) AddSpare(m Member) (View, error) {
	m = cloneMember(m)
	if m.Role == "" {
		m.Role = RoleSpare
	}
	if m.State == "" {
		m.State = StateAlive
	}
	switch {
	case m.Role != RoleSpare:
		return View{}, fmt.Errorf("add spare %q: role is %q, want %s", m.Name, m.Role, RoleSpare)
	case m.State != StateAlive:
		return View{}, fmt.Errorf("add spare %q: state is %q, want %s", m.Name, m.State, StateAlive)
	case m.Replaces != "" || m.ReplacesIncarnation != 0:
		return View{}, fmt.Errorf("add spare %q: a new spare replaces nobody (got %q)", m.Name, m.Replaces)
	case m.Incarnation != 0:
		return View{}, fmt.Errorf("add spare %q: a new member starts at incarnation 0 (got %d); a failed member comes back with Rejoin", m.Name, m.Incarnation)
	}
	if len(m.Addrs) == 0 && m.Address.IsValid() {
		m.Addrs = []netip.Addr{m.Address.Addr().Unmap()}
	}
	n, err := v.next()
	if err != nil {
		return View{}, fmt.Errorf("add spare %q: %w", m.Name, err)
	}
	n.Members = append(n.Members, m)
	return n.checked("add spare %q", m.Name)
}

// Rejoin brings failed member name back as an alive spare under its next incarnation (a repaired host,
// or one that was cut off and fenced itself): at the end of the spare FIFO, with its own host address only
// (the addresses it held went with its jobs). It leaves the ring: a failed node keeps its ring position
// only for Protector of its old jobs, which moved. What named the failed incarnation keeps naming it:
// a replacement's ReplacesIncarnation, and Standing for runs placed before (see Standing). The rejoined
// member replaces nobody any more: who it replaced once is stood for by whoever replaced it after.
// incarnation is the incarnation the caller failed as: a retried request after the rejoin succeeded
// (the member is then alive at incarnation+1) is refused instead of bumping it again.
func (v View) Rejoin(name string, incarnation uint64) (View, error) {
	i := v.index(name)
	if i < 0 {
		return View{}, fmt.Errorf("rejoin %q: not a member in view %d (a new host joins with AddSpare)", name, v.Epoch)
	}
	m := v.Members[i]
	switch {
	case m.State != StateFailed:
		return View{}, fmt.Errorf("rejoin %q: it is %s in view %d: only a failed member rejoins", name, m.State, v.Epoch)
	case m.Incarnation != incarnation:
		return View{}, fmt.Errorf("rejoin %q: it failed as incarnation %d in view %d, not %d", name, m.Incarnation, v.Epoch, incarnation)
	case m.Incarnation == math.MaxUint64:
		return View{}, fmt.Errorf("rejoin %q: incarnation overflow", name)
	case !m.Address.IsValid():
		return View{}, fmt.Errorf("rejoin %q: it has no cluster address", name)
	}
	if owner, ok := v.Owner(m.Address.Addr()); ok {
		return View{}, fmt.Errorf("rejoin %q: its host address %s is held by %s, which took it over with its jobs (they had no job addresses): the host may come back only once %s gives it up, or under another address as a new spare", name, m.Address.Addr(), owner, owner)
	}
	n, err := v.next()
	if err != nil {
		return View{}, fmt.Errorf("rejoin %q: %w", name, err)
	}
	m = Member{Name: m.Name, Address: m.Address, Role: RoleSpare, State: StateAlive,
		Addrs: []netip.Addr{m.Address.Addr().Unmap()}, Incarnation: m.Incarnation + 1}
	n.Members = append(slices.Delete(n.Members, i, i+1), m)
	return n.checked("rejoin %q", name)
}

// Fail marks an alive member failed without replacing it (a spare that died, or a node nobody can take
// over). Its host addresses are then owned by nobody. Failing the last alive node is refused: that view
// would describe no cluster at all.
func (v View) Fail(name string) (View, error) {
	i := v.index(name)
	if i < 0 || v.Members[i].State != StateAlive {
		return View{}, fmt.Errorf("fail %q: not an alive member in view %d", name, v.Epoch)
	}
	n, err := v.next()
	if err != nil {
		return View{}, fmt.Errorf("fail %q: %w", name, err)
	}
	n.Members[i].State = StateFailed
	return n.checked("fail %q", name)
}

// next is a deep copy of v with the epoch bumped.
func (v View) next() (View, error) {
	if v.Epoch == math.MaxUint64 {
		return View{}, errors.New("epoch overflow")
	}
	return View{Epoch: v.Epoch + 1, Members: cloneMembers(v.Members)}, nil
}

// checked validates a view produced by an operation, so that no operation can create a view that peers
// would refuse.
func (v View) checked(format string, args ...any) (View, error) {
	if err := v.validate(); err != nil {
		return View{}, fmt.Errorf(format+": result would be inconsistent: %w", append(args, err)...)
	}
	if err := v.fits(); err != nil {
		return View{}, fmt.Errorf(format+": %w", append(args, err)...)
	}
	return v, nil
}

// fits refuses a view whose encoding is longer than Decode accepts.
func (v View) fits() error {
	b, _ := json.Marshal(v) // cannot fail: every field marshals
	if len(b) > MaxEncoded {
		return fmt.Errorf("the view of %d members would take %d bytes, more than the %d a member accepts", len(v.Members), len(b), MaxEncoded)
	}
	return nil
}

func mergeAddrs(own, taken []netip.Addr) []netip.Addr {
	out := slices.Clone(own)
	for _, a := range taken {
		if a = a.Unmap(); !slices.ContainsFunc(out, func(b netip.Addr) bool { return b.Unmap() == a }) {
			out = append(out, a)
		}
	}
	return out
}

func cloneMember(m Member) Member {
	m.Addrs = slices.Clone(m.Addrs)
	return m
}

func cloneMembers(ms []Member) []Member {
	out := make([]Member, len(ms))
	for i, m := range ms {
		out[i] = cloneMember(m)
	}
	return out
}

// Newer reports whether b should replace a: b has a higher epoch, or the same epoch and different
// content with the larger hash of its encoding. Two agents can each derive a different view from the
// same epoch (two failures handled at once); the hash tie-break makes every agent pick the same one. An
// inconsistent b is never newer.
func Newer(a, b View) bool {
	if b.validate() != nil {
		return false
	}
	if b.Epoch != a.Epoch {
		return b.Epoch > a.Epoch
	}
	ea, _ := json.Marshal(a) // cannot fail: every field marshals
	eb, _ := json.Marshal(b)
	ha, hb := sha256.Sum256(ea), sha256.Sum256(eb)
	return bytes.Compare(hb[:], ha[:]) > 0
}

// Encode returns v as JSON; it refuses an inconsistent view so that none is ever sent or saved.
func Encode(v View) ([]byte, error) {
	if err := v.validate(); err != nil {
		return nil, fmt.Errorf("encode view %d: %w", v.Epoch, err)
	}
	return json.Marshal(v)
}

// Decode parses a view received from another agent or read from disk and refuses it unless it is
// consistent (see validate): unknown fields, trailing data and oversized input are refused too.
func Decode(b []byte) (View, error) {
	if len(b) > MaxEncoded {
		return View{}, fmt.Errorf("decode view: %d bytes, more than the %d allowed", len(b), MaxEncoded)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var v View
	if err := dec.Decode(&v); err != nil {
		return View{}, fmt.Errorf("decode view: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return View{}, errors.New("decode view: trailing data after the view")
	}
	if err := v.validate(); err != nil {
		return View{}, fmt.Errorf("decode view %d: %w", v.Epoch, err)
	}
	return v, nil
}

// Save writes v to path atomically (temporary file, fsync, rename, fsync of the directory), so that a
// crash leaves either the old view or the new one.
func Save(path string, v View) error {
	b, err := Encode(v)
	if err != nil {
		return fmt.Errorf("save view to %s: %w", path, err)
	}
	if err := atomicfile.WriteFile(path, append(b, '\n'), 0o600); err != nil { // the agent's state: root only
		return fmt.Errorf("save view: %w", err)
	}
	return nil
}

// Load reads a view saved by Save. A missing file gives an error that wraps fs.ErrNotExist (the caller
// then starts from its configuration).
func Load(path string) (View, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return View{}, fmt.Errorf("load view: %w", err)
	}
	v, err := Decode(b)
	if err != nil {
		return View{}, fmt.Errorf("load view from %s: %w", path, err)
	}
	return v, nil
}
