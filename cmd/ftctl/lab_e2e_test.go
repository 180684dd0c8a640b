package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
)

// The test binary doubles as the echo server and client that run inside lab hosts.
func TestMain(m *testing.M) {
	switch os.Getenv("FTKIT_E2E_ROLE") {
	case "echo-server":
		os.Exit(echoServer(os.Getenv("FTKIT_E2E_ADDR")))
	case "echo-client":
		os.Exit(echoClient(os.Getenv("FTKIT_E2E_ADDR")))
	case "print-addrs":
		os.Exit(printAddrs())
	case "ftctl":
		os.Exit(cli.Main(newRoot()))
	}
	os.Exit(m.Run())
}

func echoServer(addr string) int {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("listening")
	for {
		c, err := ln.Accept()
		if err != nil {
			return 1
		}
		go func() { defer c.Close(); io.Copy(c, c) }()
	}
}

// echoClient sends each stdin line over one connection and prints the echo.
func echoClient(addr string) int {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	in, back := bufio.NewScanner(os.Stdin), bufio.NewReader(c)
	for in.Scan() {
		fmt.Fprintln(c, in.Text())
		line, err := back.ReadString('\n')
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Print(line)
	}
	return 0
}

func buildFtctl(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "ftctl")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build ftctl: %v\n%s", err, out)
	}
	return bin
}

// labUp runs `ftctl lab up ARGS --subnet S` (ftctlCmd names the lab) on a subnet of the tests' range
// (lab.RandomTestSubnet), drawn again while another lab holds it: the labs of the run's other tests draw
// from the same range (ci320: TestLabSlurm's one draw met one, and `lab up` refused it). It returns the
// command's standard output.
func labUp(t *testing.T, ftctlCmd func(args ...string) *exec.Cmd, args ...string) []byte {
	t.Helper()
	for attempt := 1; ; attempt++ {
		out, err := ftctlCmd(append(append([]string{"up"}, args...), "--subnet", lab.RandomTestSubnet().String())...).Output()
		var ee *exec.ExitError
		errors.As(err, &ee)
		if ee != nil && strings.Contains(string(ee.Stderr), lab.ErrSubnetInUse.Error()) && attempt < 20 {
			continue
		}
		if err != nil {
			var stderr []byte
			if ee != nil {
				stderr = ee.Stderr
			}
			t.Fatalf("ftctl lab up %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
		}
		return out
	}
}

func TestLabEndToEnd(t *testing.T) {
	labtest.RequireRoot(t)
	ftctl := buildFtctl(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	id := fmt.Sprintf("e%05x", rand.Uint32()&0xfffff)
	ftctlCmd := func(args ...string) *exec.Cmd {
		return exec.Command(ftctl, append([]string{"lab", "--lab", id}, args...)...)
	}
	run := func(args ...string) string {
		t.Helper()
		out, err := ftctlCmd(args...).CombinedOutput()
		if err != nil {
			t.Fatalf("ftctl lab %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}

	var up lab.Status
	if err := json.Unmarshal(labUp(t, ftctlCmd, "--no-agents", "--nodes", "3", "--spares", "1", "--json"), &up); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if l, err := lab.Open(id, lab.Options{}); err == nil {
			l.Down(context.Background()) // only does anything if the test failed before its own down
		}
	})
	if len(up.Hosts) != 4 {
		t.Fatalf("lab up made %d hosts, want 4", len(up.Hosts))
	}
	if r := up.Router; r == nil || !r.Exists || !r.LinkUp || r.Role != lab.RoleRouter {
		t.Errorf("lab up's router: %+v, want one up", r)
	}
	addr3 := up.Hosts[2].Addr.Addr().String() + ":7000"

	server := ftctlCmd("exec", "node3", "--", self)
	server.Env = append(os.Environ(), "FTKIT_E2E_ROLE=echo-server", "FTKIT_E2E_ADDR="+addr3)
	serverOut, _ := server.StdoutPipe()
	if err := server.Start(); err != nil {
		t.Fatal(err)
	}
	serverDone := make(chan error, 1)
	go func() { serverDone <- server.Wait() }()
	if line, err := bufio.NewReader(serverOut).ReadString('\n'); err != nil || line != "listening\n" {
		t.Fatalf("echo server on node3: %q, %v", line, err)
	}

	client := ftctlCmd("exec", "node1", "--", self)
	client.Env = append(os.Environ(), "FTKIT_E2E_ROLE=echo-client", "FTKIT_E2E_ADDR="+addr3)
	clientIn, _ := client.StdinPipe()
	clientOut, _ := client.StdoutPipe()
	client.Stderr = os.Stderr
	if err := client.Start(); err != nil {
		t.Fatal(err)
	}
	defer client.Process.Kill()
	replies := bufio.NewReader(clientOut)
	echo := func(msg string) {
		t.Helper()
		fmt.Fprintln(clientIn, msg)
		got := make(chan string, 1)
		go func() { line, _ := replies.ReadString('\n'); got <- line }()
		select {
		case line := <-got:
			if line != msg+"\n" {
				t.Fatalf("node1 -> node3 echo of %q = %q", msg, line)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("node1 -> node3 echo of %q timed out", msg)
		}
	}
	echo("before the crash")

	run("crash", "node2")
	var after lab.Status
	if err := json.Unmarshal([]byte(run("status", "--json")), &after); err != nil {
		t.Fatal(err)
	}
	if h := after.Hosts[1]; h.Name != "node2" || !h.Crashed || h.Exists {
		t.Fatalf("node2 after crash: %+v", h)
	}
	echo("after the crash, same connection")

	// A new connection, and a failing command's exit status through `lab exec`.
	again := ftctlCmd("exec", "node1", "--", self)
	again.Env = append(os.Environ(), "FTKIT_E2E_ROLE=echo-client", "FTKIT_E2E_ADDR="+addr3)
	again.Stdin = strings.NewReader("new connection\n")
	if out, err := again.Output(); err != nil || string(out) != "new connection\n" {
		t.Fatalf("new connection node1 -> node3 after crash: %q, %v", out, err)
	}
	err = ftctlCmd("exec", "node1", "--", "sh", "-c", "exit 7").Run()
	if ee := (*exec.ExitError)(nil); !errors.As(err, &ee) || ee.ExitCode() != 7 {
		t.Fatalf("exit status through lab exec: %v, want 7", err)
	}
	clientIn.Close()

	run("down")
	select {
	case <-serverDone: // killed with node3's namespace
	case <-time.After(10 * time.Second):
		t.Fatal("echo server on node3 survived lab down")
	}
	if out := run("down"); !strings.Contains(out, "not up") {
		t.Errorf("second down said %q", out)
	}
	assertNoLeftovers(t, up)
}

func assertNoLeftovers(t *testing.T, s lab.Status) {
	t.Helper()
	hosts := s.Hosts
	if s.Router != nil {
		hosts = append(hosts[:len(hosts):len(hosts)], *s.Router)
	}
	for _, h := range hosts {
		if _, err := os.Stat(lab.NetnsPath(h.Namespace)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("namespace %s left behind", h.Namespace)
		}
		if _, err := netlink.LinkByName(h.Veth); err == nil {
			t.Errorf("veth %s left behind", h.Veth)
		}
	}
	if _, err := netlink.LinkByName(s.Bridge); err == nil {
		t.Errorf("bridge %s left behind", s.Bridge)
	}
	if _, err := os.Stat(filepath.Join(lab.DefaultStateDir, s.ID+".json")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("state file of lab %s left behind", s.ID)
	}
}
