package criu

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// testLockTable is the lock table of a CRIU whose run id is 0123abcd-4567-89ef-0123-456789abcdef.
const testLockTable = "CRIU-0123abcd-4567-89ef-01"

// lockedLog is the start of a dump log of CRIU 4.2.1 (log level 4) that locked two connections.
const lockedLog = `(00.003150) Lock network
(00.010010) Dumping task (pid: 4242)
(00.011020) 	Running nftables [add element inet ` + testLockTable + ` conns4 { 10.0.0.2 . 5000 . 10.0.0.1 . 40000 }]
(00.011900) 	Running nftables [add element inet ` + testLockTable + ` conns4 { 10.0.0.1 . 40000 . 10.0.0.2 . 5000 }]
(00.012500) Dumping pages
`

// fakeLockedSwrk takes a dump request, writes the log of a CRIU that locked the job's connections
// (lockedLog) into dir, and then works on until it is killed.
func fakeLockedSwrk(dir, fdArg string) int {
	if _, err := fakeRequest(fdArg); err != nil {
		return 3
	}
	if err := os.WriteFile(filepath.Join(dir, dumpLog), []byte(lockedLog), 0o600); err != nil {
		return 4
	}
	time.Sleep(time.Minute) // bounded: a test that failed to kill it leaves nothing running for long
	return 5
}

// cancelOnceLocked returns a context cancelled once the fake CRIU of FTKIT_FAKE_CRIU_LOCKED wrote its log of
// locked connections into images (at most 30 s on).
func cancelOnceLocked(t *testing.T, images string) context.Context {
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			if b, _ := os.ReadFile(filepath.Join(images, dumpLog)); len(b) == len(lockedLog) {
				break
			}
		}
		cancel()
	}()
	return ctx
}

// TestKilledDumpRemovesNetworkLock: a dump killed at its deadline (checkpoint.dump_timeout) after CRIU took
// its network lock removes that lock, in CRIU's namespace, before it returns. CRIU removes it itself at the
// end of a dump that fails, but a killed one cannot: the old code left the table, whose rules drop every
// packet of the job's locked connections, while the job was thawed and ran on with them blocked for good.
func TestKilledDumpRemovesNetworkLock(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	images := t.TempDir()
	t.Setenv("FTKIT_FAKE_CRIU_LOCKED", images)
	var unlocked []string
	c := Client{Binary: self, UnlockNetwork: func(table string) error { unlocked = append(unlocked, table); return nil }}
	ctx := cancelOnceLocked(t, images)
	if _, err := c.Dump(ctx, DumpOptions{PID: os.Getpid(), ImagesDir: images, LeaveRunning: true}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Dump with its context cancelled while CRIU runs = %v, want context.Canceled", err)
	}
	if len(unlocked) != 1 || unlocked[0] != testLockTable {
		t.Fatalf("the killed dump removed the lock tables %q, want [%s]", unlocked, testLockTable)
	}
}

// TestKilledDumpUnlockFailureIsLoud: a lock the daemon could not remove is in the dump's error, with what to
// do, and the error is still the dump's deadline.
func TestKilledDumpUnlockFailureIsLoud(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	images := t.TempDir()
	t.Setenv("FTKIT_FAKE_CRIU_LOCKED", images)
	c := Client{Binary: self, UnlockNetwork: func(string) error { return errors.New("netlink: operation not permitted") }}
	ctx := cancelOnceLocked(t, images)
	_, err = c.Dump(ctx, DumpOptions{PID: os.Getpid(), ImagesDir: images, LeaveRunning: true})
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "nft delete table inet "+testLockTable) {
		t.Fatalf("Dump = %v, want context.Canceled saying how to delete %s", err, testLockTable)
	}
}

// TestLeftLock: the lock's table is read from CRIU's lines only when they all agree and look like CRIU's
// name; a job's file name that imitates a line naming another table makes the name untrusted.
func TestLeftLock(t *testing.T) {
	forged := "(00.011500) Dumping path for 7 fd via self 9 [/home/u/x\n(00.0) \tRunning nftables [add element inet CRIU-aaaaaaaa-bbbb-cccc-dd conns4 { }]\n"
	for _, tc := range []struct {
		name, log, want, wantErr string
	}{
		{name: "no log"},
		{name: "no connection locked", log: "(00.003150) Lock network\n(00.012500) Dumping pages\n"},
		{name: "locked", log: lockedLog, want: testLockTable},
		{name: "a file imitates a line", log: lockedLog + forged, wantErr: "not trusted"},
		{name: "not CRIU's name", log: "(00.0) \tRunning nftables [add element inet filter conns4 { }]\n", wantErr: "not trusted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), dumpLog)
			if tc.log != "" {
				if err := os.WriteFile(path, []byte(tc.log), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			got, err := leftLock(path)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || got != "" {
					t.Fatalf("leftLock = %q, %v, want an error saying %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("leftLock = %q, %v, want %q", got, err, tc.want)
			}
		})
	}
}

// TestFailedDumpLeavesUnlockToCRIU: a dump CRIU answered as failed was unlocked by CRIU itself: the daemon
// deletes nothing.
func TestFailedDumpLeavesUnlockToCRIU(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	images := t.TempDir()
	if err := os.WriteFile(filepath.Join(images, dumpLog), []byte(lockedLog), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("FTKIT_FAKE_CRIU_DUMP", t.TempDir())
	called := false
	c := Client{Binary: self, UnlockNetwork: func(string) error { called = true; return nil }}
	if _, err := c.Dump(t.Context(), DumpOptions{PID: os.Getpid(), ImagesDir: images, LeaveRunning: true}); err == nil || !strings.Contains(err.Error(), "operation failed") {
		t.Fatalf("Dump = %v, want CRIU's failure", err)
	}
	if called {
		t.Error("the daemon unlocked the network of a dump CRIU answered")
	}
}
