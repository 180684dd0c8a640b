// Package intercept holds ftkit's transparent interposition below unmodified programs: the receive-order
// determinants of a protected job, from where they are recorded to the replay that makes a restored copy
// consume its connections' bytes in the order and amounts the original did.
//
// The model is RADIC's HM_PL (pessimistic logging of the receive sequence numbers of wildcard receives,
// ../shared/notes/seed-000-digest.md), moved from inside an MPI library to the socket layer:
//
//   - On the host a job runs on, an eBPF program (ebpfprobes.RecvOrder) sees every receive call of the
//     job's processes on a TCP socket and records a Det: which connection, how far the socket's
//     copied_seq reached, how many bytes the call returned. The agent numbers a job's determinants in the
//     order the ring buffer holds them (a total order consistent with each thread's program order) and
//     ships them to the job's protector as Batches.
//   - The protector keeps them in a Store, next to the job's replicas. A snapshot needs no marker in the
//     stream: consumption is monotonic per connection, so the determinants after a snapshot are exactly
//     the suffix whose events consumed past the snapshot's copied_seq (Since).
//   - On the spare, Gate replays them: the restored sockets start with empty receive queues, and the bytes
//     each determinant consumed are injected (as TCP segments from the peer) only once the restored
//     program made the receive call before it. A program whose only non-determinism is which socket it
//     reads first and how much each read returns then re-executes identically.
//
// Logging is optimistic: determinants travel to the protector while the program goes on, so a crash can
// lose the last ones, and with them the cause of bytes the program already sent (an orphan). A replay
// never hides that: after the last determinant the restored job reads freely, and every byte it re-sends is
// still checked against what its peers received (restore/recovery), so an orphan ends in a named failure,
// never in a wrong result.
package intercept
