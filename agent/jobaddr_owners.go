package agent

import (
	"context"
	"net/netip"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ring"
)

// Who holds a job address. A host address is in the view (ring.View.Owner); a job address is not: it moves
// with its job (a fail-over, a rejoin, a manual restore), so each member says which ones its running jobs
// hold (its ping reply) and this directory asks every alive member when it needs an address it does not
// know, after every view change, and when its answer is older than jobAddrMaxAge. Callers that must not
// wait (the log's capture loop) take what it knew and start a refresh; the others wait for the answers.
type jobAddrOwners struct {
	mu      sync.Mutex
	owners  map[netip.Addr]string // from the last refresh; an address two members claimed is left out
	epoch   uint64                // the view epoch that refresh started in
	at      time.Time             // when it started
	pending chan struct{}         // closed when the refresh in progress ends; nil when none runs
	warned  sync.Map              // member and pool overlapping this host's pool, logged once
}

const (
	// jobAddrRetry is how soon an address nobody claimed may be asked for again.
	jobAddrRetry = time.Second
	// jobAddrMaxAge bounds how long an answer is used without asking again (a manual restore moves a job
	// address without a view change).
	jobAddrMaxAge = 30 * time.Second
	// jobAddrAskTimeout bounds each member's answer.
	jobAddrAskTimeout = 2 * time.Second
	// maxJobAddrsPerMember bounds what one member may claim (a /20 pool plus the jobs it took over).
	maxJobAddrsPerMember = 8192
	// maxAmbiguousLogged bounds the addresses claimed by two members that one refresh logs one by one.
	maxAmbiguousLogged = 8
)

// holderOf is the alive member that holds ip now: a host address in the view, or the address of a job
// running on a member (wait: within ctx, ask the members about an address the directory does not know,
// unless they were asked since asked).
func (a *Agent) holderOf(ctx context.Context, ip netip.Addr, wait bool, asked time.Time) string {
	ip = ip.Unmap()
	v := a.View()
	if name, ok := v.Owner(ip); ok {
		return name
	}
	if !a.mayBeJobAddr(ip) {
		return ""
	}
	if a.runsJobAddr(ip) {
		return a.cfg.Name
	}
	return a.jobAddrs.owner(ctx, a, v.Epoch, ip, wait, asked)
}

// mayBeJobAddr says whether ip could be a job address: an IPv4 address of the cluster network. Nothing else
// is asked of the members.
func (a *Agent) mayBeJobAddr(ip netip.Addr) bool {
	cluster, ok := a.clusterPrefix()
	return ok && ip.Is4() && cluster.Contains(ip)
}

// clusterPrefix is the cluster network (the cluster interface's address with its length), looked up once.
func (a *Agent) clusterPrefix() (netip.Prefix, bool) {
	a.clusterNet.once.Do(func() {
		if _, own, err := a.cfg.ClusterNetwork(); err == nil {
			a.clusterNet.prefix = own.Masked()
		}
	})
	return a.clusterNet.prefix, a.clusterNet.prefix.IsValid()
}

// runsJobAddr says whether a running job of this host holds job address ip.
func (a *Agent) runsJobAddr(ip netip.Addr) bool { return a.runningJobNet(ip) != nil }

// runningJobNet is the job network of the running job of this host that holds job address ip, nil if none
// does.
func (a *Agent) runningJobNet(ip netip.Addr) *JobNet {
	a.mu.Lock()
	defer a.mu.Unlock()
	return jobNetHolding(a.byID, a.cfg.Name, ip)
}

// jobNetHolding is the job network of the running job of node among jobs that holds job address ip, nil if
// none does.
func jobNetHolding(jobs map[string]*Job, node string, ip netip.Addr) *JobNet {
	for _, j := range jobs {
		if n := ownJobNet(j, node); n != nil && n.Addr.Addr() == ip {
			c := *n
			return &c
		}
	}
	return nil
}

// ownJobNet is j's job network if j is a running job of node on a job address of its own, else nil.
func ownJobNet(j *Job, node string) *JobNet {
	if j.State == JobRunning && j.Net != nil && j.Node == node {
		return j.Net
	}
	return nil
}

// runningJobAddrs are the job addresses of this host's running jobs (what its ping reply says).
func (a *Agent) runningJobAddrs() []netip.Addr {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []netip.Addr
	for _, j := range a.byID {
		if n := ownJobNet(j, a.cfg.Name); n != nil {
			out = append(out, n.Addr.Addr())
		}
	}
	return out
}

// owner looks ip up. The directory answers when it is of the current view and young enough; otherwise a
// refresh runs (one at a time). A caller that waits for an unknown address wants a refresh that started
// after it asked (a job started a moment ago is in no older answer); one that does not wait takes what the
// directory knew, and starts a refresh at most once per jobAddrRetry for an address nobody claimed. asked
// is when the caller's question arose (ownerLookup: a batch's start, which one refresh answers).
func (d *jobAddrOwners) owner(ctx context.Context, a *Agent, epoch uint64, ip netip.Addr, wait bool, asked time.Time) string {
	for {
		d.mu.Lock()
		name, known := d.owners[ip]
		current := d.owners != nil && d.epoch == epoch
		age := time.Since(d.at)
		switch {
		case current && known && age < jobAddrMaxAge,
			current && !known && !wait && age < jobAddrRetry,
			current && !known && wait && !d.at.Before(asked):
			d.mu.Unlock()
			return name
		}
		if d.pending == nil {
			d.pending = make(chan struct{})
			go d.refresh(a, d.pending)
		}
		done := d.pending
		d.mu.Unlock()
		if !wait {
			return name // what it knew, if anything: the refresh corrects it
		}
		select {
		case <-done:
		case <-ctx.Done():
			return name
		}
		epoch = a.View().Epoch
	}
}

// refresh asks every other alive member which job addresses it holds, then closes done.
func (d *jobAddrOwners) refresh(a *Agent, done chan struct{}) {
	v := a.View()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), jobAddrAskTimeout)
	defer cancel()
	claims := make([][]netip.Addr, len(v.Members))
	pools := make([]netip.Prefix, len(v.Members))
	var wg sync.WaitGroup
	for i, m := range v.Members {
		if m.State != ring.StateAlive || m.Name == a.cfg.Name {
			continue
		}
		wg.Go(func() {
			rep, err := a.peers().Ping(ctx, m.Name)
			if err != nil || rep.Node != m.Name {
				return // a member that does not answer holds nothing we could reach anyway
			}
			claims[i], pools[i] = a.validJobAddrs(m.Name, rep.JobAddrs), rep.JobPool
		})
	}
	wg.Wait()
	a.warnOverlappingPools(v, pools)
	owners := map[netip.Addr]string{}
	ambiguous := map[netip.Addr][]string{}
	for i, addrs := range claims {
		for _, ip := range addrs {
			if o, dup := owners[ip]; dup && o != v.Members[i].Name {
				ambiguous[ip] = append(ambiguous[ip], o, v.Members[i].Name)
			}
			owners[ip] = v.Members[i].Name
		}
	}
	logged := 0
	for ip, who := range ambiguous {
		// Two copies of one job (a host cut off that has not fenced itself yet): nobody's, until one is gone.
		delete(owners, ip)
		// A line each for the first few only: a member claiming thousands of other members' addresses
		// would otherwise log thousands of lines at every refresh, which any member's trim can start.
		if logged < maxAmbiguousLogged {
			logged++
			a.log.Warn("a job address is claimed by two members: neither is used for it until one copy is gone", "addr", ip, "members", who)
		}
	}
	if more := len(ambiguous) - logged; more > 0 {
		a.log.Warn("more job addresses are claimed by two members than are logged one by one: neither is used for them until one copy is gone",
			"not_logged", more)
	}
	d.mu.Lock()
	d.owners, d.epoch, d.at, d.pending = owners, v.Epoch, start, nil
	d.mu.Unlock()
	close(done)
}

// validJobAddrs keeps the addresses member claims that could be job addresses: IPv4 addresses of the
// cluster network that are no member's host address, at most maxJobAddrsPerMember of them. What it ignores
// is logged in one line, naming the first: a ping answer may list ~10^5 addresses, and a line each (with a
// scan of every member's addresses each) let one member flood this agent's log at every refresh.
func (a *Agent) validJobAddrs(member string, addrs []netip.Addr) []netip.Addr {
	hosts := map[netip.Addr]bool{}
	for _, h := range a.memberAddrs() {
		hosts[h] = true
	}
	var out []netip.Addr
	var first netip.Addr
	ignored := 0
	for _, ip := range addrs {
		ip = ip.Unmap()
		if !a.mayBeJobAddr(ip) || hosts[ip] || len(out) == maxJobAddrsPerMember {
			if ignored == 0 {
				first = ip
			}
			ignored++
			continue
		}
		out = append(out, ip)
	}
	// Once per reply, not per address: a reply holds up to some 100 000 of them (clusterapi.MaxMessage),
	// and the directory is refreshed every few seconds.
	if ignored > 0 {
		a.log.Warn("a member claims job addresses it cannot hold (not of the cluster network, a host's, or beyond the most a member may hold); ignored",
			"member", member, "ignored", ignored, "first", first, "max", maxJobAddrsPerMember)
	}
	return out
}

// warnOverlappingPools logs, once per pair, each member whose job_network.pool overlaps this host's: two
// agents could hand out one address to two jobs (pools are configured per host; nothing else coordinates
// them).
func (a *Agent) warnOverlappingPools(v ring.View, pools []netip.Prefix) {
	own := a.cfg.JobNetwork.Pool
	if !own.IsValid() {
		return
	}
	for i, p := range pools {
		if !p.IsValid() || !p.Overlaps(own) {
			continue
		}
		if _, seen := a.jobAddrs.warned.LoadOrStore(v.Members[i].Name+" "+p.String(), true); !seen {
			a.log.Error("job_network.pool overlaps another member's: both may hand out one address to two jobs; give every agent a pool of its own",
				"pool", own, "member", v.Members[i].Name, "its_pool", p)
		}
	}
}
