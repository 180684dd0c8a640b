package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/lab/labcluster"
)

// The ring program's run (testdata/mpich/ring.c): iterations, compute per iteration, print every so many.
// Each iteration every rank sends ringHalo bytes to each of its two neighbours.
const (
	ringIters = 400
	ringWork  = 500
	ringEvery = 20
	ringHalo  = 512 * 8
)

// mpichRing builds testdata/mpich/ring.c with Debian's MPICH and returns the binary, in a directory every
// lab host (and the spare a rank is restored on) sees.
func mpichRing(t *testing.T) string {
	t.Helper()
	requirePrograms(t, "mpicc.mpich", "mpiexec.mpich")
	dir := t.TempDir()
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "ring")
	if out, err := exec.Command("mpicc.mpich", "-O2", "-Wall", "-o", bin, filepath.Join("testdata", "mpich", "ring.c")).CombinedOutput(); err != nil {
		t.Fatalf("build the MPICH ring program: mpicc.mpich: %v\n%s", err, out)
	}
	return bin
}

// ringLines is the ring program's output so far: its "iter N sum HASH" lines and its "done" line.
func ringLines(out string) []string {
	var lines []string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "iter ") || strings.HasPrefix(l, "done ") {
			lines = append(lines, l)
		}
	}
	return lines
}

// ringOutput is the whole output of a finished ring run, which every correct run prints the same.
func ringOutput(t *testing.T, out string) string {
	t.Helper()
	lines := ringLines(out)
	if want := ringIters/ringEvery + 1; len(lines) != want || !strings.HasPrefix(lines[len(lines)-1], "done ") {
		t.Fatalf("want %d iteration lines and a done line, got %d lines in:\n%s", want-1, len(lines), tail(out))
	}
	return strings.Join(lines, "\n")
}

// ringRows counts the ring program's output lines so far.
func ringRows(out string) int { return len(ringLines(out)) }

// sharedMappings lists the shared mappings (System V segments, /dev/shm files, memfds: any mapping with
// the "s" flag) of every process of the job whose root is pid, as "comm[pid]: path". CRIU's own memfd is
// not one: compel maps "CRIUMFD" into every process it dumps while an ftkit snapshot runs (seen once in the
// job's /bin/sh, 1 of 5 runs).
func sharedMappings(t *testing.T, pid int) []string {
	t.Helper()
	return jobMappings(t, pid, func(perms, path string) bool {
		return len(perms) == 4 && perms[3] == 's' && !strings.HasPrefix(path, "/memfd:CRIUMFD")
	})
}

// jobMappings lists the mappings that match of every process of the job whose root is pid, as
// "comm[pid]: path".
func jobMappings(t *testing.T, pid int, match func(perms, path string) bool) []string {
	t.Helper()
	ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid))
	if err != nil {
		t.Fatalf("the job's PID namespace: %v", err)
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if other, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", p)); err != nil || other != ns {
			continue
		}
		maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", p))
		if err != nil { // the process exited meanwhile
			continue
		}
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", p))
		for _, l := range strings.Split(string(maps), "\n") {
			// address perms offset dev inode path
			if f := strings.Fields(l); len(f) >= 2 && match(f[1], strings.Join(f[5:], " ")) {
				out = append(out, fmt.Sprintf("%s[%d]: %s", strings.TrimSpace(string(comm)), p, strings.Join(f[5:], " ")))
			}
		}
	}
	return out
}

// sentTo sums, over the TCP connections from host to the address to in host's sender-side log, how far
// each one's sequence number has come (snd_nxt, per connection).
func sentTo(t *testing.T, c *labcluster.Cluster, host string, to netip.Addr) map[string]uint32 {
	t.Helper()
	conns, err := c.Client(host).LoggedConns(context.Background())
	if err != nil {
		t.Fatalf("logged connections of %s: %v", host, err)
	}
	out := map[string]uint32{}
	for _, lc := range conns {
		if lc.Dst.Addr() == to && lc.Live != nil {
			out[lc.Src.String()+">"+lc.Dst.String()] = lc.Live.SndNxt
		}
	}
	return out
}

// requireTCPBetweenRanks checks, while the ring runs, that every rank's bytes to each neighbour cross the
// lab network as TCP (logged by the sender's agent): for every ordered pair of rank hosts, the sender's
// connections to the other advance by at least the halos of the iterations between two samples. Ranks
// that talked through shared memory would leave these connections idle.
func requireTCPBetweenRanks(t *testing.T, c *labcluster.Cluster, r *mpiRun, hosts []string) {
	t.Helper()
	addr := map[string]netip.Addr{}
	for _, h := range c.Lab.State().Hosts {
		addr[h.Name] = h.Addr.Addr()
	}
	sample := func() map[[2]string]map[string]uint32 {
		s := map[[2]string]map[string]uint32{}
		for _, from := range hosts {
			for _, to := range hosts {
				if from != to {
					s[[2]string{from, to}] = sentTo(t, c, from, addr[to])
				}
			}
		}
		return s
	}
	n := len(ringLines(r.out.String()))
	before := sample()
	// Two more lines: at least ringEvery whole iterations run between the samples.
	r.waitRows(t, ringRows, n+2, 2*time.Minute)
	after := sample()
	for pair, b := range before {
		var sent uint32
		for k, a := range after[pair] {
			if at, ok := b[k]; ok { // a connection new since the first sample has no known start: not counted
				sent += a - at // serial arithmetic
			}
		}
		if sent < ringEvery*ringHalo {
			t.Errorf("%s sent %d bytes over TCP to %s in %d iterations, want at least %d (the halos): do its ranks talk through shared memory? connections before %v, after %v",
				pair[0], sent, pair[1], ringEvery, ringEvery*ringHalo, b, after[pair])
		}
	}
}

// TestMPICHFailover runs a small deterministic MPI program built with Debian's MPICH (mpicc.mpich, ch4:ucx,
// launched by hydra through `ftctl mpirun --impl mpich`), one rank per lab node, each host's hydra proxy
// and rank one protected job: first without failure (where it also checks that no rank maps shared memory
// and that the ranks' bytes cross the network between every pair of hosts: lab hosts share one hostname),
// then with node2 snapshotted and crashed mid-run. The run must print the same hashes, node2's job must be
// restored on the spare and exit 0, and the other hosts' jobs must be untouched.
func TestMPICHFailover(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	ring := mpichRing(t)
	c := newMPICluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	impl := []string{"--impl", "mpich"}
	prog := []string{ring, strconv.Itoa(ringIters), strconv.Itoa(ringWork), strconv.Itoa(ringEvery)}
	hosts := []string{"node1", "node2", "node3"}

	start := time.Now()
	ref := startMPIWith(t, c, impl, "ref", "", nil, prog...)
	ref.waitRows(t, ringRows, 1, 2*time.Minute)
	for _, h := range hosts {
		pid := jobNamed(t, c, h, "ref-"+h).PID
		if shm := sharedMappings(t, pid); len(shm) > 0 {
			t.Errorf("%s's MPICH job maps shared memory:\n%s", h, strings.Join(shm, "\n"))
		}
		// Without it MPI_Finalize hangs in about half of the runs, and a snapshot at the start can leave
		// the proxy deaf to its rank (scripts/mpi/ftkit-mpich-finalize.c).
		preloaded := jobMappings(t, pid, func(_, path string) bool { return strings.HasSuffix(path, "/libftkit-mpich.so") })
		for _, comm := range []string{"ring[", "hydra_pmi_proxy["} {
			if !slices.ContainsFunc(preloaded, func(m string) bool { return strings.HasPrefix(m, comm) }) {
				t.Errorf("%s: no %s process maps libftkit-mpich.so (LD_PRELOAD); the job's processes that do: %q", h, strings.TrimSuffix(comm, "["), preloaded)
			}
		}
	}
	requireTCPBetweenRanks(t, c, ref, hosts)
	ref.wait(t)
	want := ringOutput(t, ref.out.String())
	t.Logf("failure-free run: %s", time.Since(start).Round(time.Millisecond))

	start = time.Now()
	r := startMPIWith(t, c, impl, "ft", "", nil, prog...)
	failNode2MidRun(t, c, r, ringRows)
	t.Logf("run with node2 crashed: %s", time.Since(start).Round(time.Millisecond))
	if got := ringOutput(t, r.out.String()); got != want {
		t.Errorf("output after fail-over:\n%s\nwithout failure:\n%s", got, want)
	}
}
