package agent

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt/dump"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/jobnet"
)

// Job addresses (issue 12, docs/job-addresses.md): a job that asks for one (JobSpec.JobAddress) runs in a
// network namespace of its own (package jobnet) whose only interface holds an address from this agent's
// pool. Fail-over moves that address with the job, so the failed host keeps its own and can come back.

// JobNet is a job's own network: its namespace's name on the host it runs on, the interface kind and the
// job's address with the cluster network's prefix length.
type JobNet struct {
	Name string       `json:"name"`
	Kind jobnet.Kind  `json:"kind"`
	Addr netip.Prefix `json:"addr"`
}

// netAddr is the address of job j's network, none for a job without one.
func (j *Job) netAddr() netip.Prefix {
	if j.Net == nil {
		return netip.Prefix{}
	}
	return j.Net.Addr
}

// jobNetName is the name of job id's network namespace on node. It names the host too: on one machine
// (the lab) several hosts share /run/netns, and a restored job must not meet its old copy's namespace.
func jobNetName(node, id string) string {
	h := fnv.New32a()
	h.Write([]byte(node))
	const prefix = 4 + 8 + 1 // "ftj-", the hash, "-"
	if max := 64 - prefix; len(id) > max {
		id = id[len(id)-max:] // keeps the id's random suffix
	}
	return fmt.Sprintf("ftj-%08x-%s", h.Sum32(), id)
}

// checkPeerJobNet validates the job network of a job record from another node (a replica's, restored
// here) before any of it is used. Pools are per host, so the address cannot be checked against this
// host's pool; it is trusted as far as this: a unicast IPv4 host address of the cluster network this
// host's own interface is on (cluster is that address, with its length), with that length, and not a
// member's host address (which would steal a host's address from the wire). A member able to forge a
// replica can forge its images, which CRIU restores as root anyway (see checkPeerJob); what is refused
// here is what would hurt this host's own network: another subnet, a host's address, a bad name.
func checkPeerJobNet(n *JobNet, cluster netip.Prefix, members []netip.Addr) error {
	if n == nil {
		return nil
	}
	if err := jobnet.ValidName(n.Name); err != nil {
		return fmt.Errorf("job record field \"net.name\": %w", err)
	}
	if _, err := (jobnet.Spec{Name: n.Name, Parent: "eth0", Kind: n.Kind, Addr: n.Addr}).Validate(); err != nil {
		return fmt.Errorf("job record field \"net\": %w", err)
	}
	if n.Addr.Bits() != cluster.Bits() || !cluster.Masked().Contains(n.Addr.Addr()) {
		return fmt.Errorf("job record field \"net.addr\" is %s, want an address of this host's cluster network %s with its prefix length", n.Addr, cluster.Masked())
	}
	if slices.Contains(members, n.Addr.Addr()) {
		return fmt.Errorf("job record field \"net.addr\" is %s, a member's host address", n.Addr.Addr())
	}
	return nil
}

// memberAddrs are the host addresses of every member this agent knows of: configured and in the view.
func (a *Agent) memberAddrs() []netip.Addr {
	var out []netip.Addr
	for _, m := range a.cfg.Cluster.Members {
		out = append(out, m.Address.Addr().Unmap())
	}
	for _, m := range a.View().Members {
		out = append(out, m.Address.Addr().Unmap())
		out = append(out, m.Addrs...)
	}
	return out
}

// allocJobAddr picks the first address of the pool held by no job record of this agent (addressHeld) nor
// reserved (reservedAddrs), and reserves it: call releaseJobAddr with it once the job is listed, or did not
// start. a.mu must not be held.
func (a *Agent) allocJobAddr() (netip.Prefix, error) {
	pool := a.cfg.JobNetwork.Pool
	if !pool.IsValid() {
		return netip.Prefix{}, errors.New("this agent hands out no job addresses ([job_network] pool is not set in its configuration): start the job without a job address, or configure a pool")
	}
	_, own, err := a.cfg.ClusterNetwork()
	if err != nil {
		return netip.Prefix{}, err
	}
	members := a.memberAddrs()
	a.mu.Lock()
	defer a.mu.Unlock()
	used := map[netip.Addr]bool{}
	for _, j := range a.byID {
		if addressHeld(j) {
			used[j.Net.Addr.Addr()] = true
		}
	}
	for ip := range a.reservedAddrs {
		used[ip] = true
	}
	for _, ip := range members {
		used[ip] = true
	}
	// The router the job networks route through may be inside the pool: a job with its address would take
	// it from the router, and jobnet refuses such a network anyway (every later start would pick it again).
	if gw := a.cfg.JobNetwork.Gateway; gw.IsValid() {
		used[gw.Unmap()] = true
	}
	p, ok := pickJobAddr(pool, own, used)
	if !ok {
		return netip.Prefix{}, fmt.Errorf("job_network.pool %s is exhausted: every address is held by a running job, one being started, or an ended job's network until its closes are acknowledged (job_network.linger)", pool)
	}
	a.reservedAddrs[p.Addr()]++
	return p, nil
}

// addressHeld says whether job record j's address may be in use, here or on the host the job moved to: a
// job that runs; one that vanished without an exit record (lost: a crash, after which a protector may have
// restored it elsewhere with its address); one that self-fencing killed (its protector restores it), or that
// was migrated (it runs on with its address on the target). Only a
// job that ended here otherwise (exited, killed by a user) gives its address back. An address is never
// reused while a moved copy may hold it, at the cost of leaking the addresses of lost jobs that never
// moved: nothing tells this agent where a job went (no coordination of addresses across hosts yet).
func addressHeld(j *Job) bool {
	return j.Net != nil && (j.State == JobRunning || j.State == JobLost || j.State == JobMoved || j.Fenced)
}

// otherHolder names a job of this host other than j whose record holds j's address (addressHeld), "" if
// none: restoring j from an old snapshot (a job that ended, its address given out again) would put one
// address on two jobs.
func (a *Agent) otherHolder(j Job) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.otherHolderLocked(j)
}

// otherHolderLocked is otherHolder with a.mu held.
func (a *Agent) otherHolderLocked(j Job) string {
	if j.Net == nil {
		return ""
	}
	for id, o := range a.byID {
		if id != j.ID && addressHeld(o) && o.Net.Addr.Addr().Unmap() == j.Net.Addr.Addr().Unmap() {
			return id
		}
	}
	return ""
}

// reserveRestoredAddr reserves job j's address for its restore on this host (releaseJobAddr gives it back
// once the restored job is listed, or its network is deleted), or refuses the restore: another job of this
// host holds the address (otherHolder), a job being started got it (allocJobAddr), or the network of
// another job that ended here still holds it on the wire (finish). The check and the hold are one step
// under a.mu: checked alone, a start during the restore (CRIU: seconds) or one whose network was being made
// as the restore began handed out or kept the address, and two job networks of this host held it.
func (a *Agent) reserveRestoredAddr(j Job) error {
	if j.Net == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.restoredAddrFreeLocked(j); err != nil {
		return err
	}
	a.reservedAddrs[j.Net.Addr.Addr()]++
	return nil
}

// checkRestoredAddr refuses what reserveRestoredAddr refuses, holding nothing: a restore that makes the
// job's network before restoreJob (a rollback's guard) must not put on the wire an address another job of
// this host holds. restoreJob's refusal comes too late then: it returns before anything it would delete
// is its own, and the network stayed, answering for the other job's address.
func (a *Agent) checkRestoredAddr(j Job) error {
	if j.Net == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.restoredAddrFreeLocked(j)
}

// restoredAddrFreeLocked is reserveRestoredAddr's check, with a.mu held; j.Net is set.
func (a *Agent) restoredAddrFreeLocked(j Job) error {
	ip := j.Net.Addr.Addr()
	if other := a.otherHolderLocked(j); other != "" {
		// The refusal reaches the user who asked for the restore (and the job's failure timeline): another
		// user's job is named in the log only.
		holder := "job " + other
		if a.byID[other].UID != j.UID {
			a.log.Warn("restore refused: another user's job of this host holds the job's address", "job", j.ID, "address", ip, "holder", other)
			holder = "another user's job"
		}
		return fmt.Errorf("job %s cannot be restored here: its address %s is held by %s of this host now (the job's address was given out again after it ended)",
			j.ID, ip, holder)
	}
	// The holds the job's own earlier copy may have here: finish reserved the address for its network
	// until that is deleted (endedHeld), and a restore claims that network (claimJobNet); one that could not
	// be deleted holds it by its name (holdLeftAddr). Counted only while they are there: once the ended
	// copy's network is gone and the address given back, a hold on it is a starting job's.
	own := 0
	if o := a.byID[j.ID]; o != nil && o.Net != nil && !addressHeld(o) && o.Net.Addr.Addr() == ip {
		own += a.endedHeld[o.Net.Name]
	}
	if a.leftHeld[jobNetName(a.cfg.Name, j.ID)] == ip {
		own++
	}
	if a.reservedAddrs[ip] > own {
		return fmt.Errorf("job %s cannot be restored here now: its address %s is being given to a job starting on this host, or is still held by the network of a job that ended here until its closed connections are acknowledged (job_network.linger): try again in a few seconds",
			j.ID, ip)
	}
	return nil
}

// pickJobAddr is the first address of pool that is not used and not the network or broadcast address of
// the cluster network own is in, with own's prefix length.
func pickJobAddr(pool, own netip.Prefix, used map[netip.Addr]bool) (netip.Prefix, bool) {
	cluster := own.Masked()
	for ip := pool.Addr(); pool.Contains(ip); ip = ip.Next() {
		if used[ip] || !cluster.Contains(ip) || ip == cluster.Addr() || ip == lastAddr(cluster) {
			continue
		}
		return netip.PrefixFrom(ip, own.Bits()), true
	}
	return netip.Prefix{}, false
}

// releaseJobAddr ends one hold on ip (allocJobAddr, reserveRestoredAddr).
func (a *Agent) releaseJobAddr(ip netip.Addr) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.releaseJobAddrLocked(ip)
}

// releaseJobAddrLocked is releaseJobAddr with a.mu held.
func (a *Agent) releaseJobAddrLocked(ip netip.Addr) {
	if a.reservedAddrs[ip]--; a.reservedAddrs[ip] <= 0 {
		delete(a.reservedAddrs, ip)
	}
}

// releaseEndedAddr ends the hold finish made on ip for the network name of an ended job (endedHeld).
func (a *Agent) releaseEndedAddr(name string, ip netip.Addr) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.endedHeld[name]--; a.endedHeld[name] <= 0 {
		delete(a.endedHeld, name)
	}
	a.releaseJobAddrLocked(ip)
}

// lastAddr is the broadcast address of an IPv4 prefix.
func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().As4()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3]) | ^uint32(0)>>p.Bits()
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// jobNetSpec is the jobnet.Spec of n on this host.
func (a *Agent) jobNetSpec(n *JobNet) (jobnet.Spec, error) {
	parent := a.cfg.JobNetwork.Parent
	if parent == "" {
		iface, _, err := a.cfg.ClusterNetwork()
		if err != nil {
			return jobnet.Spec{}, err
		}
		parent = iface
	}
	return jobnet.Spec{Name: n.Name, Parent: parent, Kind: n.Kind, Addr: n.Addr, Gateway: a.cfg.JobNetwork.Gateway}.Validate()
}

// jobNetOps stand in for package jobnet where set (tests: a job network made, or one that cannot be
// deleted, without the kernel's namespaces).
type jobNetOps struct {
	create func(ctx context.Context, n *JobNet) error   // all of createJobNet
	delete func(ctx context.Context, name string) error // jobnet.Delete
	exists func(name string) (bool, error)              // jobnet.Exists, for removeOrphanJobNet
}

// createJobNet creates job j's network on this host (idempotent).
func (a *Agent) createJobNet(ctx context.Context, n *JobNet) error {
	if a.nets.create != nil {
		return a.nets.create(ctx, n)
	}
	s, err := a.jobNetSpec(n)
	if err != nil {
		return err
	}
	a.claimJobNet(ctx, n.Name)
	if err := jobnet.Create(ctx, s); err != nil {
		return fmt.Errorf("create the job's network %s (%s on %s): %w", s.Name, s.Addr, s.Parent, err)
	}
	return nil
}

// withdrawJobNet takes job id's address off the wire at once (its network, if this agent's, stays until
// deleteJobNet); if that fails, it deletes the network instead, which takes the address too.
func (a *Agent) withdrawJobNet(ctx context.Context, id string, n *JobNet) {
	if n == nil {
		return
	}
	if n.Name == jobNetName(a.cfg.Name, id) {
		err := jobnet.Withdraw(n.Name)
		if err == nil {
			return
		}
		a.log.Warn("could not take the job's address off its network; deleting the network now", "job", id, "net", n.Name, "err", err)
	}
	a.deleteJobNet(ctx, id, n)
}

// removeJobNetNamed deletes the job network name (jobnet.Delete, or a test's), nothing more: deleteJobNet
// and the retry of a left network (retryLeftNet) keep the records and the address holds.
func (a *Agent) removeJobNetNamed(ctx context.Context, name string) error {
	if a.nets.delete != nil {
		return a.nets.delete(ctx, name)
	}
	return jobnet.Delete(ctx, name, "")
}

// deleteJobNet removes job id's network if it is this agent's (never a name from a record as such). The
// error says the network may still hold its address on the wire: the address stays held by the network's
// name (holdLeftAddr) until a deletion of it succeeds, whatever hold the caller gives back.
func (a *Agent) deleteJobNet(ctx context.Context, id string, n *JobNet) error {
	if n == nil {
		return nil
	}
	if want := jobNetName(a.cfg.Name, id); n.Name != want {
		a.log.Warn("job record names a job network that is not this agent's for the job; not removing it", "job", id, "net", n.Name, "want", want)
		return nil
	}
	if err := a.removeJobNetNamed(ctx, n.Name); err != nil {
		a.log.Error("delete job network: its address may stay on the wire", "job", id, "net", n.Name, "err", err)
		a.noteLeftNet(n.Name, leftNet{Job: id, Addr: n.Addr}, true) // the next agent deletes it again (retryLeftNets)
		a.holdLeftAddr(n.Name, n.Addr)
		return fmt.Errorf("delete job network %s: %w", n.Name, err)
	}
	a.noteLeftNet(n.Name, leftNet{}, false)
	a.releaseLeftAddr(n.Name)
	a.log.Info("job network deleted", "job", id, "net", n.Name, "addr", n.Addr)
	return nil
}

// netLingers says whether the network of job j, ending in state, outlives the rest of the job
// (releaseEnded): a job that exited keeps it while connections it closed still send their last bytes and
// FIN (jobnet.Closing), for up to job_network.linger, its address held meanwhile. The network of a job that
// self-fencing killed, or that was lost (it may run on elsewhere with its address), goes at once.
func (a *Agent) netLingers(j *Job, state JobState) bool {
	return j.Net != nil && state == JobExited && !j.Fenced && a.cfg.JobNetwork.Linger.Duration > 0 &&
		j.Net.Name == jobNetName(a.cfg.Name, j.ID)
}

// releaseEnded gives back what job j held once it ended. A lingering network (netLingers) is deleted once
// its closes are acknowledged. The address finish reserved (reserved) is given back once the network is
// gone: before, a job started meanwhile would get an address the old network still holds on the wire. A
// network that could not be deleted keeps it reserved by its name (deleteJobNet) until it is deleted.
func (a *Agent) releaseEnded(j *Job, lingers, reserved bool) {
	if !lingers {
		a.releaseJob(j)
		if reserved {
			a.releaseEndedAddr(j.Net.Name, j.Net.Addr.Addr())
		}
		return
	}
	n := *j.Net
	a.releaseResources(j)
	a.lingering.add(n.Name, j.ID, n.Addr)
	go func() {
		a.awaitCloses(j.ID, n.Name, a.cfg.JobNetwork.Linger.Duration)
		if !a.lingering.take(n.Name, func(string, netip.Prefix) { a.deleteJobNet(context.Background(), j.ID, &n) }) {
			return // a claim took it: endLingering gives the address back once it tried to delete the network
		}
		a.releaseEndedAddr(n.Name, n.Addr.Addr()) // one still on the wire holds it by its name (deleteJobNet)
	}()
}

// awaitCloses waits until job network name holds no connection whose close its peer has not acknowledged,
// for up to linger, or until a new copy of the job takes the name over.
func (a *Agent) awaitCloses(id, name string, linger time.Duration) {
	start := time.Now()
	for a.lingering.has(name) {
		n, err := jobnet.Closing(name)
		switch {
		case err == nil && n == 0:
			if waited := time.Since(start); waited > closePoll {
				a.log.Info("ended job's network kept until its closed connections were acknowledged", "job", id, "net", name, "ms", waited.Milliseconds())
			}
			return
		case time.Since(start) >= linger:
			a.log.Warn("deleting an ended job's network although some connections it closed are not acknowledged: their peers may wait for an end that never comes",
				"job", id, "net", name, "closing", n, "linger", linger, "err", err)
			return
		}
		time.Sleep(closePoll)
	}
}

// closePoll is how often awaitCloses looks: a FIN retransmission comes no sooner than TCP's 200 ms minimum RTO.
const closePoll = 50 * time.Millisecond

// lingerNets are the networks of ended jobs that outlive them (releaseEnded): job ids by network name. A
// new copy of the job restored on this host takes the name over: the old network, whose sockets are its
// previous copy's (on the same 4-tuples), is deleted first, and its lingering ends without touching the
// new one.
type lingerNets struct {
	mu sync.Mutex
	m  map[string]lingerNet
}

// lingerNet is a lingering network's ended job and the address the network holds: a claim that cannot
// delete it records and keeps that address (endLingering).
type lingerNet struct {
	id   string
	addr netip.Prefix
}

func (l *lingerNets) add(name, id string, addr netip.Prefix) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string]lingerNet{}
	}
	l.m[name] = lingerNet{id, addr}
}

func (l *lingerNets) has(name string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.m[name]
	return ok
}

// take runs remove with the ended job's id and its network's address if name lingers, and forgets the
// name; it reports whether it did. The lingering's own end and a new copy's claim both take it: whichever
// comes first deletes the old network, the other finds nothing.
func (l *lingerNets) take(name string, remove func(id string, addr netip.Prefix)) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	n, ok := l.m[name]
	if ok {
		remove(n.id, n.addr)
		delete(l.m, name)
	}
	return ok
}

// claimJobNet ends the lingering of a network an ended copy of a job left under name, deleting it, before
// a new copy's network is made with that name.
func (a *Agent) claimJobNet(ctx context.Context, name string) {
	// A running agent's retry of a network left undeleted under this name (retryLeftNet) ends first: its
	// deletion would take down the network made next.
	a.waitLeftNetRetry()
	a.endLingering(ctx, name, "a new copy of an ended job comes to this host while the old one's network lingers: deleting that first")
}

// endLingering deletes the network an ended copy of a job left lingering under name, if any, saying why.
func (a *Agent) endLingering(ctx context.Context, name, why string) {
	a.lingering.take(name, func(id string, addr netip.Prefix) {
		a.log.Warn(why, "job", id, "net", name)
		// The hold finish made on the address is this claim's to give back (the lingering's end finds the
		// network taken), once the deletion was tried: a network that cannot be deleted holds the address by
		// its name (deleteJobNet), and its record keeps it for the next agent.
		a.deleteJobNet(ctx, id, &JobNet{Name: name, Addr: addr})
		if addr.IsValid() {
			a.releaseEndedAddr(name, addr.Addr())
		}
	})
}

// removeOrphanJobNet deletes the job network this agent would have made for job id, if there is one (why
// says how it was left): a recovery interrupted after creating it and before the job ran, or an agent that
// stopped while an ended job's network lingered, leaves it, its address answering with nothing behind it.
// addr is the job's address where the caller knows it: a network that cannot be deleted holds it
// (deleteJobNet), and its record keeps it for the next agent to reserve (retryLeftNets).
func (a *Agent) removeOrphanJobNet(ctx context.Context, id string, addr netip.Prefix, why string) error {
	if !validJobID(id) {
		return nil
	}
	name := jobNetName(a.cfg.Name, id)
	exists := jobnet.Exists
	if a.nets.exists != nil {
		exists = a.nets.exists
	}
	if ok, err := exists(name); err != nil || !ok {
		return nil
	}
	a.log.Warn("removing the job network of a job that does not run here", "job", id, "net", name, "why", why)
	return a.deleteJobNet(ctx, id, &JobNet{Name: name, Addr: addr})
}

// holdLeftAddr keeps addr, held on the wire by job network name that could not be deleted, from the next
// job until a deletion of the network succeeds (releaseLeftAddr; the left-networks record keeps it after a
// restart). One hold per network: every failed try comes here. An unknown address holds nothing.
func (a *Agent) holdLeftAddr(name string, addr netip.Prefix) {
	if !addr.IsValid() {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.leftHeld[name]; ok {
		return
	}
	if a.leftHeld == nil {
		a.leftHeld = map[string]netip.Addr{}
	}
	if a.reservedAddrs == nil {
		a.reservedAddrs = map[netip.Addr]int{}
	}
	a.leftHeld[name] = addr.Addr()
	a.reservedAddrs[addr.Addr()]++
}

// releaseLeftAddr ends the hold holdLeftAddr made for job network name, deleted now, if any: before, the
// address stayed out of the pool until the agent restarted.
func (a *Agent) releaseLeftAddr(name string) {
	a.mu.Lock()
	ip, ok := a.leftHeld[name]
	delete(a.leftHeld, name)
	a.mu.Unlock()
	if ok {
		a.releaseJobAddr(ip)
	}
}

// inJobNet runs fn inside job network n (fn's forks inherit it), or as is for a job without one.
func inJobNet(n *JobNet, fn func() error) error {
	if n == nil {
		return fn()
	}
	return jobnet.Do(n.Name, fn)
}

// dumperFor is the CRIU dumper of a job: inside its job network when it has one.
func (a *Agent) dumperFor(j Job) dump.Dumper {
	if j.Net == nil {
		return a.criu
	}
	return netnsDumper{c: a.criu, netns: jobnet.Path(j.Net.Name)}
}

type netnsDumper struct {
	c     criu.Client
	netns string
}

func (d netnsDumper) Dump(ctx context.Context, opts criu.DumpOptions) (criu.DumpStats, error) {
	opts.Netns = d.netns
	return d.c.Dump(ctx, opts)
}
