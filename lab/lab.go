package lab

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/ftkit/ftkit/criu"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// killTimeout bounds how long a crash or teardown waits for SIGKILLed processes to disappear.
const killTimeout = 10 * time.Second

// stopBound bounds how long a crash or teardown waits for the host's processes to stop before it kills them
// (a process in an uninterruptible sleep stops only when it leaves it).
const stopBound = time.Second

// Lab is a handle on a lab that exists on this machine.
type Lab struct {
	store stateStore
	log   *slog.Logger
	st    State
	// tearingDown, when set (tests), runs in Down between the state's update and the hosts' removal.
	tearingDown func()
}

// Options locate the state directory and the logger; the zero value uses DefaultStateDir and slog's default.
type Options struct {
	StateDir string
	Logger   *slog.Logger
}

func (o Options) store() stateStore {
	if o.StateDir == "" {
		return stateStore{dir: DefaultStateDir}
	}
	return stateStore{dir: o.StateDir}
}

func (o Options) logger() *slog.Logger {
	if o.Logger == nil {
		return slog.Default()
	}
	return o.Logger
}

// ErrExists means a lab with that id, or one of its namespaces or links, already exists.
var ErrExists = errors.New("lab already exists")

// ErrSubnetInUse means the requested subnet overlaps another lab or an address of this machine.
var ErrSubnetInUse = errors.New("subnet in use")

// Up creates the lab described by cfg. On failure it removes whatever it created.
func Up(ctx context.Context, cfg Config, opts Options) (*Lab, error) {
	plan, err := NewPlan(cfg)
	if err != nil {
		return nil, err
	}
	l := &Lab{store: opts.store(), log: opts.logger().With("lab", plan.ID), st: State{Plan: plan, Phase: PhaseCreating, Owner: cfg.Owner}}
	err = l.store.locked(func() error {
		if err := l.checkFree(); err != nil {
			return err
		}
		// Written before anything is created, so that Down can undo a half-done Up after a crash.
		return l.store.save(l.st)
	})
	if err != nil {
		return nil, err
	}
	err = l.create(ctx)
	if err == nil && cfg.Slurm {
		err = l.startSlurm(ctx)
	}
	if err != nil {
		if derr := l.Down(context.WithoutCancel(ctx)); derr != nil {
			err = errors.Join(err, fmt.Errorf("cleaning up the half-created lab: %w", derr))
		}
		return nil, err
	}
	if err := l.markUp(); err != nil {
		if derr := l.Down(context.WithoutCancel(ctx)); derr != nil {
			err = errors.Join(err, fmt.Errorf("cleaning up the created lab: %w", derr))
		}
		return nil, err
	}
	return l, nil
}

// markUp records that Up is done. The state is reloaded under the lock, not saved from memory: another
// lab's Down may have handed its munged over to this lab meanwhile (handOverMunged), and must not be lost.
func (l *Lab) markUp() error {
	return l.update(func(st *State) { st.Phase = PhaseUp })
}

// checkFree refuses a lab whose id, namespaces, links or subnet are taken. Called with the store locked.
func (l *Lab) checkFree() error {
	labs, err := l.store.all()
	if err != nil {
		return err
	}
	for _, other := range labs {
		if other.ID == l.st.ID {
			return fmt.Errorf("%w: lab %q is already up (state %s); run `ftctl lab down` first", ErrExists, l.st.ID, l.store.path(l.st.ID))
		}
		if other.Subnet.Overlaps(l.st.Subnet) {
			return fmt.Errorf("%w: %s overlaps lab %q's %s; pick another with --subnet", ErrSubnetInUse, l.st.Subnet, other.ID, other.Subnet)
		}
	}
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("list this machine's addresses: %w", err)
	}
	for _, a := range addrs {
		ip, _ := netip.AddrFromSlice(a.IP.To4())
		ones, _ := a.Mask.Size()
		if p := netip.PrefixFrom(ip, ones); p.Overlaps(l.st.Subnet) {
			return fmt.Errorf("%w: %s overlaps %s on interface index %d of this machine; pick another with --subnet", ErrSubnetInUse, l.st.Subnet, p, a.LinkIndex)
		}
	}
	if _, err := netlink.LinkByName(l.st.Bridge); err == nil {
		return fmt.Errorf("%w: link %s exists; remove it or run `ftctl lab down --lab %s`", ErrExists, l.st.Bridge, l.st.ID)
	}
	for _, h := range l.st.namespaces() {
		if _, err := os.Stat(NetnsPath(h.Namespace)); err == nil {
			return fmt.Errorf("%w: network namespace %s exists; remove it with `ip netns delete %s`", ErrExists, h.Namespace, h.Namespace)
		}
		if _, err := netlink.LinkByName(h.Veth); err == nil {
			return fmt.Errorf("%w: link %s exists; remove it with `ip link delete %s`", ErrExists, h.Veth, h.Veth)
		}
	}
	return nil
}

func (l *Lab) create(ctx context.Context) error {
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: l.st.Bridge}}
	if err := netlink.LinkAdd(br); err != nil {
		return fmt.Errorf("create bridge %s: %w", l.st.Bridge, err)
	}
	if err := netlink.LinkSetUp(br); err != nil {
		return fmt.Errorf("bring up bridge %s: %w", l.st.Bridge, err)
	}
	for _, h := range l.st.Hosts {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := l.createHost(br, h); err != nil {
			return fmt.Errorf("create host %s: %w", h.Name, err)
		}
		l.log.Debug("host up", "host", h.Name, "addr", h.Addr, "netns", h.Namespace)
	}
	if err := l.createHost(br, l.st.Router); err != nil {
		return fmt.Errorf("create the lab's router: %w", err)
	}
	if err := configureRouter(l.st.Router); err != nil {
		return err
	}
	return nil
}

// configureRouter makes every address outside the lab's subnet local to the router (a `local 0.0.0.0/0`
// route), so that it answers for them itself: a TCP SYN gets a reset, a UDP datagram an ICMP port
// unreachable, which fail a connect or a DNS lookup at once. Its ICMP rate limit is off, else a burst of
// lookups (mpirun resolves every host name) would again wait for timeouts. Nothing is forwarded.
func configureRouter(r Host) error {
	return InNetns(NetnsPath(r.Namespace), func() error {
		if err := os.WriteFile("/proc/sys/net/ipv4/icmp_ratelimit", []byte("0"), 0); err != nil {
			return fmt.Errorf("router %s: turn off the ICMP rate limit: %w", r.Namespace, err)
		}
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return fmt.Errorf("router %s: find lo: %w", r.Namespace, err)
		}
		all := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: lo.Attrs().Index, Dst: all, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST}); err != nil {
			return fmt.Errorf("router %s: route every outside address to itself: %w", r.Namespace, err)
		}
		return nil
	})
}

// createHost adds the namespace and a veth pair whose inner end becomes eth0 with the host's address.
func (l *Lab) createHost(br *netlink.Bridge, h Host) error {
	if err := createNamedNetns(h.Namespace); err != nil {
		return err
	}
	ns, err := netns.GetFromPath(NetnsPath(h.Namespace))
	if err != nil {
		return fmt.Errorf("open namespace: %w", err)
	}
	defer ns.Close()
	// The peer is created inside the host (then renamed to eth0), so that its interface index comes from the
	// host's own counter. Created in the root namespace and moved, it kept the root's index, which grows with
	// every lab: past 32767 Open MPI's PMIx (4.2.2) matches no interface and mpirun fails ("The PMIx server's
	// listener thread failed to start"), seen on a machine that had run the suite many times.
	peer := h.Veth + "p"
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: h.Veth, MasterIndex: br.Index},
		PeerName:      peer,
		PeerNamespace: netlink.NsFd(ns),
	}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("create veth %s with its peer in %s: %w", h.Veth, h.Namespace, err)
	}
	if err := netlink.LinkSetUp(veth); err != nil {
		return fmt.Errorf("bring up %s: %w", h.Veth, err)
	}
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("netlink handle in %s: %w", h.Namespace, err)
	}
	defer nh.Close()
	lo, err := nh.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo: %w", err)
	}
	if err := nh.LinkSetUp(lo); err != nil {
		return fmt.Errorf("bring up lo: %w", err)
	}
	inner, err := nh.LinkByName(peer)
	if err != nil {
		return fmt.Errorf("find %s inside: %w", peer, err)
	}
	if err := nh.LinkSetName(inner, "eth0"); err != nil {
		return fmt.Errorf("rename %s to eth0: %w", peer, err)
	}
	addr, err := netlink.ParseAddr(h.Addr.String())
	if err != nil {
		return err
	}
	if err := nh.AddrAdd(inner, addr); err != nil {
		return fmt.Errorf("add %s to eth0: %w", h.Addr, err)
	}
	if err := nh.LinkSetUp(inner); err != nil {
		return fmt.Errorf("bring up eth0: %w", err)
	}
	return nil
}

// Open returns the lab with the given id ("" for DefaultID).
func Open(id string, opts Options) (*Lab, error) {
	if id == "" {
		id = DefaultID
	}
	store := opts.store()
	st, err := store.load(id)
	if err != nil {
		return nil, err
	}
	return &Lab{store: store, log: opts.logger().With("lab", id), st: st}, nil
}

// List returns the state of every lab on this machine.
func List(opts Options) ([]State, error) {
	return opts.store().all()
}

// State returns a copy of the lab's recorded state.
func (l *Lab) State() State {
	st := l.st
	st.Hosts = append([]Host(nil), l.st.Hosts...)
	return st
}

// Host returns the host by name.
func (l *Lab) Host(name string) (Host, error) { return l.st.Host(name) }

// NetnsPath is the namespace file of a host, for nsenter-style entry by other tools.
func (l *Lab) NetnsPath(host string) (string, error) {
	h, err := l.live(host)
	if err != nil {
		return "", err
	}
	return NetnsPath(h.Namespace), nil
}

// live returns a host that exists and has not crashed.
func (l *Lab) live(name string) (Host, error) {
	h, err := l.st.Host(name)
	if err != nil {
		return Host{}, err
	}
	if h.Crashed {
		return Host{}, fmt.Errorf("host %s of lab %s has crashed; it no longer exists", name, l.st.ID)
	}
	return h, nil
}

// Do runs fn on a thread inside host's network namespace.
func (l *Lab) Do(host string, fn func() error) error {
	p, err := l.NetnsPath(host)
	if err != nil {
		return err
	}
	return InNetns(p, fn)
}

// Start starts cmd inside host's network namespace (host mount namespace, nsenter --net semantics).
func (l *Lab) Start(host string, cmd *exec.Cmd) error {
	return l.Do(host, cmd.Start)
}

// Crash is a fail-stop of a whole host: every process in its namespace is SIGKILLed, then the namespace
// and its veth are deleted. Nothing on the host survives.
func (l *Lab) Crash(ctx context.Context, name string) error {
	var h Host
	err := l.store.locked(func() error {
		st, err := l.store.load(l.st.ID)
		if err != nil {
			return err
		}
		l.st = st
		h, err = l.live(name)
		return err
	})
	if err != nil {
		return err
	}
	// The cut itself runs without the store's lock, which every lab of the machine shares: another lab's
	// teardown (seconds, with GBs of snapshots to remove) must not delay a fault a test injects now.
	if err := removeHost(ctx, h); err != nil {
		return fmt.Errorf("crash %s: %w", name, err)
	}
	return l.store.locked(func() error {
		st, err := l.store.load(l.st.ID)
		if err != nil {
			return err
		}
		l.st = st
		for i := range l.st.Hosts {
			if l.st.Hosts[i].Name == name {
				l.st.Hosts[i].Crashed = true
			}
		}
		if err := l.slurmHostGone(name); err != nil {
			return fmt.Errorf("crash %s: %w", name, err)
		}
		l.log.Info("host crashed", "host", name)
		return l.store.save(l.st)
	})
}

// Revive brings a crashed host back as it was planned: its namespace, its veth on the bridge, its
// original address, and its Slurm daemons if the lab runs Slurm. Its agent is lab/labcluster's concern.
func (l *Lab) Revive(ctx context.Context, name string) error {
	err := l.store.locked(func() error {
		st, err := l.store.load(l.st.ID)
		if err != nil {
			return err
		}
		l.st = st
		h, err := l.st.Host(name)
		if err != nil {
			return err
		}
		if !h.Crashed {
			return fmt.Errorf("host %s of lab %s is not crashed; only a crashed host can be revived", name, l.st.ID)
		}
		// Today's fail-over moves a failed host's address to the spare: two hosts with one address on
		// the bridge would break both.
		for _, o := range l.st.Hosts {
			if o.Crashed || o.Name == name {
				continue
			}
			for _, a := range hostStatus(o).Addrs {
				if a.Addr() == h.Addr.Addr() {
					return fmt.Errorf("revive %s: its address %s is now on %s (taken over); release it there first", name, h.Addr.Addr(), o.Name)
				}
			}
		}
		link, err := netlink.LinkByName(l.st.Bridge)
		if err != nil {
			return fmt.Errorf("revive %s: find bridge %s: %w", name, l.st.Bridge, err)
		}
		br, ok := link.(*netlink.Bridge)
		if !ok {
			return fmt.Errorf("revive %s: link %s is a %s, not a bridge", name, l.st.Bridge, link.Type())
		}
		if err := l.createHost(br, h); err != nil {
			return errors.Join(fmt.Errorf("revive %s: %w", name, err), removeHost(ctx, h))
		}
		for i := range l.st.Hosts {
			if l.st.Hosts[i].Name == name {
				l.st.Hosts[i].Crashed = false
			}
		}
		l.log.Info("host revived", "host", name, "addr", h.Addr)
		return l.store.save(l.st)
	})
	if err != nil {
		return err
	}
	if err := l.reviveSlurm(ctx, name); err != nil {
		return fmt.Errorf("revive %s: %w", name, err)
	}
	return nil
}

// removeHost stops the host's processes, cuts its veth, kills the processes and deletes its namespace; what is already gone is
// fine. The veth goes first because it is deleted synchronously, while a namespace's own links disappear
// later, from a kernel work queue.
func removeHost(ctx context.Context, h Host) error {
	var errs []error
	// Everything stops before anything goes, as in a power cut (stopNetns).
	if err := stopNetns(NetnsPath(h.Namespace), stopBound); err != nil {
		errs = append(errs, err)
	}
	if link, err := netlink.LinkByName(h.Veth); err == nil {
		if err := netlink.LinkDel(link); err != nil && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("delete veth %s: %w", h.Veth, err))
		}
	}
	if err := killNetns(ctx, NetnsPath(h.Namespace), killTimeout); err != nil {
		// The namespace's name is the only handle on the processes left in it: deleted now, the next Down
		// would find nothing to kill and they would outlive the lab (stopped, holding its cgroups).
		return errors.Join(append(errs, err)...)
	}
	if err := deleteNamedNetns(h.Namespace); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Down removes everything the lab created. It is safe to call twice and after a half-done Up.
func (l *Lab) Down(ctx context.Context) error {
	var errs []error
	gone := false
	err := l.store.locked(func() error {
		if st, err := l.store.load(l.st.ID); err == nil {
			l.st = st
		} else if errors.Is(err, fs.ErrNotExist) {
			gone = true
			return nil
		}
		// Slurm's daemons get a SIGTERM first (removing a host SIGKILLs what is left in it), under the
		// lock: munged runs outside every host and may be handed over to another lab's state.
		if err := l.stopSlurm(ctx); err != nil {
			errs = append(errs, fmt.Errorf("stop Slurm: %w", err))
		}
		return nil
	})
	if err != nil || gone {
		return err
	}
	if l.tearingDown != nil {
		l.tearingDown()
	}
	// What follows touches only this lab's namespaces, links and directories, so it runs without the
	// lock every lab of the machine shares: removing GBs of snapshots must not hold up another lab's
	// crash or start. The state file, kept until the end, still reserves the lab's names and subnet.
	for _, h := range l.st.namespaces() {
		if err := removeHost(ctx, h); err != nil {
			errs = append(errs, fmt.Errorf("host %s: %w", h.Name, err))
		}
	}
	for _, d := range l.st.Dirs {
		if err := removeTree(d); err != nil {
			errs = append(errs, err)
		}
	}
	if link, err := netlink.LinkByName(l.st.Bridge); err == nil {
		if err := netlink.LinkDel(link); err != nil && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("delete bridge %s: %w", l.st.Bridge, err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("lab %s is partly down (state kept, run down again): %w", l.st.ID, errors.Join(errs...))
	}
	l.log.Debug("lab down")
	return l.store.locked(func() error { return l.store.remove(l.st.ID) })
}

// AddCleanup records a directory that Down must remove after the lab's processes are dead. A directory
// under a cgroup2 mount is removed bottom-up with rmdir, as cgroups require.
func (l *Lab) AddCleanup(dir string) error {
	return l.store.locked(func() error {
		st, err := l.store.load(l.st.ID)
		if err != nil {
			return err
		}
		for _, d := range st.Dirs {
			if d == dir {
				return nil
			}
		}
		st.Dirs = append(st.Dirs, dir)
		l.st = st
		return l.store.save(st)
	})
}

// removeTree removes a directory tree; cgroup directories cannot hold files, so they are rmdir'ed
// deepest first.
func removeTree(dir string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		// A CRIU killed in the middle of a restore leaves its cgroup yard (a tmpfs with cgroup mounts)
		// in the lab's restore directory: removed without entering it.
		return criu.RemoveWorkDir(dir)
	}
	var dirs []string
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	var errs []error
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := unix.Rmdir(dirs[i]); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", dirs[i], err))
		}
	}
	return errors.Join(errs...)
}
